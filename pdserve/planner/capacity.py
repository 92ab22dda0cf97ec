"""What a split could serve at best, from the timing model: `worker_rates` (one worker's throughput
bounds for a sample) and `split_estimate` (a split's, from them). The search starts each split
from its estimate."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.disaggregate_modes import parse_disaggregate
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import Split
from pdserve.planner.workload import ProbeRequest
from pdserve.sim.timing import Chunk, StepWork


@dataclass(frozen=True)
class WorkerRates:
    """Requests/s one worker serves at best, from the timing model (see `worker_rates`)."""

    prefill: float  # prompts of a prefill worker computing full steps
    decode: float  # requests a decode worker decodes in full batches
    colocated: float  # requests of a worker that prefills and decodes


def worker_rates(deployment: Deployment, sample: list[ProbeRequest]) -> WorkerRates:
    """Throughput bounds of one worker for the sample's mean lengths (a prefill worker at the
    prefill pool's TP, the others at the deployment's): prefill at full steps,
    decode at full batches, colocated steps decoding the batch and prefilling the prompts that
    replace the requests it finishes (within the step's token budget)."""
    engine, meter = deployment.new_engine()
    timing, config = meter.timing, deployment.engine_config
    prompt = sum(len(r.prompt) for r in sample) / len(sample)
    output = sum(r.output_len for r in sample) / len(sample)
    chunk = min(config.max_num_batched_tokens, max(1, round(prompt)))
    prefill_timing = deployment.for_role("prefill").new_engine()[1].timing  # its TP's
    prefill_step = prefill_timing.step_seconds(StepWork.of([Chunk(0, chunk, False)], 1))
    prefill_rate = chunk / prefill_step / prompt  # prompts/s of one worker
    context = round(prompt + output / 2)
    batch = max(1, min(config.max_num_seqs, engine.block_manager.num_blocks * config.block_size
                       // max(1, round(prompt + output))))  # fmt: skip
    decode_step = timing.step_seconds(StepWork.of([Chunk(context, 1, True)] * batch, batch))
    decode_rate = batch / decode_step / output  # requests/s of one worker
    colocated = 1 / (1 / prefill_rate + 1 / decode_rate)  # prefill and decode steps in turn
    prompt_tokens = min(round(batch * prompt / output), config.max_num_batched_tokens - batch)
    if prompt_tokens >= 1:  # the scheduler mixes them in one step
        chunks = [Chunk(context, 1, True)] * batch + [Chunk(0, prompt_tokens, False)]
        mixed_step = timing.step_seconds(StepWork.of(chunks, batch + 1))
        colocated = max(colocated, min(batch / output, prompt_tokens / prompt) / mixed_step)
    return WorkerRates(prefill_rate, decode_rate, colocated)


def split_estimate(rates: WorkerRates, split: Split, disaggregate: str = "always") -> float:
    """Requests/s `split` could serve at best: colocated workers (and decode workers when the
    router never disaggregates) at the colocated rate, else the prefill or the decode pool,
    whichever is slower. A router that may also prefill on decode workers (`auto`, the rules)
    can do better than that: its bound is then the decode workers at the colocated rate with
    the prefill workers' prompts on top. (How often it prefills locally is its policy's
    choice, which no bound here predicts: the search calibrates the estimates by the goodputs
    found instead. Without the local side the search's ceiling, MAX_OVER_ESTIMATE x this,
    stopped `auto` 1P:7D on code completion at 610 req/s, half what colocated served.)"""
    p, d = split.prefill, split.decode
    if p == 0 or disaggregate == "never":
        return d * rates.colocated
    if parse_disaggregate(disaggregate).kind == "always":
        return min(p * rates.prefill, d * rates.decode)
    return d * rates.colocated + p * rates.prefill
