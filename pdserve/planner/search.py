"""The search: goodput of every split of the GPUs, by bisection over the request rate.

Goodput (DistServe's) is the highest rate at which at least `slo.attainment` of the requests
meet both SLOs. Each split's search starts from `capacity_estimate` (throughput bounds from the
timing model: prefill at full steps, decode at full batches) and walks down by halves until a
probe passes (a failing probe is cheap: it stops as soon as the misses exceed what the
attainment allows), then bisects geometrically until the bracket is within `precision`.
Splits are searched best estimate first; once `top` splits have a goodput, another split is
first probed at the lowest of them, and dropped (`pruned`) when it fails there: it cannot be
among the best. Colocated is reported as the recommendation unless the best disaggregated
split beats it by more than `precision`.

Replicas: a split whose worker counts share a factor k is simulated as one of its k identical
replicas (P/k prefill and D/k decode workers) at 1/k of the rate, as DistServe replicates a
placement: the router spreads load evenly over identical workers, and a probe of a smaller
cluster needs proportionally fewer requests to reach the same load. Every simulated replica
keeps at least `min_replica_workers` workers, so the router still chooses among several.
A probe offers `requests_per_worker` requests per simulated worker (at most the sample).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.config import RouterConfig
from pdserve.planner.cluster import RouterTiming
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, ProbeResult, Split, run_probe
from pdserve.planner.workload import ProbeRequest
from pdserve.sim.timing import Chunk, StepWork

MIN_RATE = 1e-3  # requests/s: below this a split serves nothing within the SLOs
# A split still passing at this multiple of its estimate absorbs the whole sample as one
# burst: its goodput is reported as at least that rate (`saturated`), more requests per probe
# would tell more.
MAX_OVER_ESTIMATE = 16


@dataclass
class SplitResult:
    split: Split
    estimate: float  # requests/s the timing model's throughput bounds allow
    replicas: int = 1  # the split is simulated as one of this many identical replicas
    goodput: float = 0.0  # highest rate that passed (0: none did)
    failed_at: float | None = None  # lowest rate that failed
    best: ProbeResult | None = None  # the probe at `goodput`
    probes: list[ProbeResult] = field(default_factory=list)
    pruned: bool = False  # failed at the top splits' lowest goodput: not searched further
    saturated: bool = False  # passed even at MAX_OVER_ESTIMATE x the estimate


@dataclass
class Plan:
    results: list[SplitResult]  # best first
    precision: float
    seconds: float  # wall time of the search
    probes: int

    @property
    def best(self) -> SplitResult:
        return self.results[0]

    @property
    def recommended(self) -> SplitResult:
        """The best split, or colocated when disaggregating gains no more than the precision."""
        colocated = next((r for r in self.results if r.split.prefill == 0), None)
        best = self.best
        if colocated is not None and best.goodput <= colocated.goodput * (1 + self.precision):
            return colocated
        return best


def all_splits(workers: int) -> list[Split]:
    """Colocated over every worker, and every P:D with P + D = workers."""
    return [Split(0, workers)] + [Split(p, workers - p) for p in range(1, workers)]


def replica_count(split: Split, min_workers: int) -> int:
    """The most identical replicas `split` divides into, each of at least `min_workers`."""
    common = math.gcd(split.prefill, split.decode)
    workers = split.prefill + split.decode
    fits = [k for k in range(1, common + 1) if common % k == 0 and workers // k >= min_workers]
    return max(fits, default=1)


def capacity_estimate(deployment: Deployment, split: Split, sample: list[ProbeRequest]) -> float:
    """Requests/s the split could serve at best: prefill workers computing full steps, decode
    workers decoding full batches (colocated workers share their time between the two)."""
    engine, meter = deployment.new_engine()
    timing, config = meter.timing, deployment.engine_config
    prompt = sum(len(r.prompt) for r in sample) / len(sample)
    output = sum(r.output_len for r in sample) / len(sample)
    chunk = min(config.max_num_batched_tokens, max(1, round(prompt)))
    prefill_step = timing.step_seconds(StepWork.of([Chunk(0, chunk, False)], 1))
    prefill_rate = chunk / prefill_step / prompt  # prompts/s of one worker
    context = round(prompt + output / 2)
    batch = max(1, min(config.max_num_seqs, engine.block_manager.num_blocks * config.block_size
                       // max(1, round(prompt + output))))  # fmt: skip
    decode_step = timing.step_seconds(StepWork.of([Chunk(context, 1, True)] * batch, batch))
    decode_rate = batch / decode_step / output  # requests/s of one worker
    if split.prefill == 0:
        return split.decode / (1 / prefill_rate + 1 / decode_rate)
    return min(split.prefill * prefill_rate, split.decode * decode_rate)


class Search:
    def __init__(
        self,
        deployment: Deployment,
        sample: list[ProbeRequest],
        slo: SLO,
        router_config: RouterConfig,
        timing: RouterTiming = RouterTiming(),
        precision: float = 0.05,
        top: int = 3,
        requests_per_worker: int = 500,
        min_replica_workers: int = 2,
        on_probe: Callable[[ProbeResult], None] | None = None,
    ) -> None:
        self.deployment, self.sample, self.slo = deployment, sample, slo
        self.router_config, self.timing = router_config, timing
        self.precision, self.top = precision, top
        self.requests_per_worker = requests_per_worker
        self.min_replica_workers = min_replica_workers
        self.on_probe = on_probe
        self.probes = 0

    def run(self, splits: list[Split]) -> Plan:
        started = time.perf_counter()
        results = [
            SplitResult(
                s,
                capacity_estimate(self.deployment, s, self.sample),
                replica_count(s, self.min_replica_workers),
            )
            for s in splits
        ]
        searched: list[SplitResult] = []
        for result in sorted(results, key=lambda r: -r.estimate):
            goodputs = sorted((r.goodput for r in searched if r.goodput > 0), reverse=True)
            threshold = goodputs[self.top - 1] if len(goodputs) >= self.top else 0.0
            self._search(result, threshold)
            searched.append(result)
        results.sort(key=lambda r: (-r.goodput, r.pruned, r.split.prefill))
        return Plan(results, self.precision, time.perf_counter() - started, self.probes)

    def _probe(self, result: SplitResult, rate: float) -> bool:
        k, split = result.replicas, result.split
        replica = Split(split.prefill // k, split.decode // k)
        size = self.requests_per_worker * (replica.prefill + replica.decode)
        probe, _ = run_probe(
            self.deployment,
            replica,
            self.sample[:size],
            rate / k,
            self.slo,
            self.router_config,
            self.timing,
        )
        probe.split, probe.rate = split, rate
        self.probes += 1
        result.probes.append(probe)
        if self.on_probe is not None:
            self.on_probe(probe)
        if probe.passed:
            if rate > result.goodput:
                result.goodput, result.best = rate, probe
        elif result.failed_at is None or rate < result.failed_at:
            result.failed_at = rate
        return probe.passed

    def _search(self, result: SplitResult, threshold: float) -> None:
        if threshold > 0 and not self._probe(result, threshold):
            result.pruned = True
            return
        rate = max(result.estimate, threshold * 2, MIN_RATE)
        ceiling = max(rate, result.estimate * MAX_OVER_ESTIMATE)
        # Bracket: the lowest failing rate above the highest passing one.
        while result.failed_at is None:
            if rate > ceiling:
                result.saturated = True
                return
            if not self._probe(result, rate):
                break
            rate *= 2
        while result.goodput == 0.0:
            rate = result.failed_at / 2
            if rate < MIN_RATE:
                return
            self._probe(result, rate)
        while result.failed_at / result.goodput > 1 + self.precision:
            self._probe(result, (result.failed_at * result.goodput) ** 0.5)
