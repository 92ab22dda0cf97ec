"""`pdserve bench spec`: decode tokens/s without speculation, with prompt lookup (ngram) and with
a draft model, in one run, on two workloads (spec_workloads.py): `repeating`, whose output
repeats its context, and `novel`, where next to nothing is accepted.

The draft is `--draft-model`, else a self-speculative draft of the target written for the run
(`make-model --draft-of`: its first `--draft-layers` layers, default a quarter). Each cell
(workload, batch) gets a fresh engine per mode, one unmeasured warm-up run each, then
`--repeats` rounds of measured runs of the same prompts, the modes in rotation; the median
decode rate is reported: output tokens after the first of each request over the seconds from
every request having its first token to the end, in CPU seconds of this process by default
(`--clock cpu`; `--threads` defaults to 1, so that is the work itself, however loaded the
machine) or elapsed (`--clock wall`).

Per speculative mode it prints the acceptance rate (accepted / drafted tokens), Leviathan et
al.'s per-token acceptance alpha fitted to the measured tokens per verification
(1 + accepted / verifications = (1 - alpha^(k+1)) / (1 - alpha)), the measured cost ratio c
(draft: a plain engine's decode step on the draft over the target's, same prompts and batch;
ngram: the lookups of one step over the target's step), the analytical speedup limit
(1 - alpha^(k+1)) / ((1 - alpha)(1 + k c)), the measured speedup and speedup / limit. When the
engine's self switch-off pauses speculation, steps run plain and the speedup tends to 1.

alpha counts only the steps that verified drafts. A sequence's step without a proposal (prompt
lookup found no earlier occurrence, or the switch-off paused proposing) emits one token at a
plain step's cost, which the limit above does not count; `alpha*` is fitted instead to the
tokens per sequence-step over every decode step (decode tokens / (decode tokens - accepted)),
so a step without a proposal counts as one whose drafts were all rejected, and `limit*` and
`/limit*` are the limit and the ratio with it: the speedup a machine where verifying k + 1
positions costs one plain step would get from the same proposals. The issue's target is read
against `limit*` (the run ends with a note saying why, TARGET_NOTE).

`--device` (cpu, cuda, cuda:N) and `--dtype` place target and draft; on CUDA the clock is
elapsed time read after synchronizing the device (`--clock cpu` would count only the host's
launches), and the engines' compiled decode follows `--compile` (auto: on for CUDA).

`--prompt-kv LENGTHS` measures instead where a disaggregated pair should compute the draft's
prompt KV (spec_prompt_kv.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.models.presets import WEIGHT_PRESETS

MODES = ("off", "ngram", "draft")
# cpu: this process's CPU seconds; with one torch thread that is the work itself, whatever
# else runs on the machine. wall: elapsed seconds.
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
DRAFT_ALONE = "draft-alone"  # a plain engine on the draft model: the draft's step cost
BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=WEIGHT_PRESETS,
        default="small",
        help="target (default: small; medium: one a CPU step is memory-bound on)",
    )
    parser.add_argument("--model", default=None, help="a target model directory instead")
    parser.add_argument(
        "--residual-scale",
        type=float,
        default=None,
        metavar="S",
        help="write the preset for the run with this residual scale (`make-model "
        "--residual-scale`): a target its first-layers draft agrees with (default: the "
        "built-in preset, scale 1)",
    )
    parser.add_argument("--draft-model", default=None, help="draft directory (default: see above)")
    parser.add_argument(
        "--draft-layers", type=int, default=None, help="layers of the written draft"
    )
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated (default: 1,8)")
    parser.add_argument(
        "-k", "--num-speculative-tokens", type=int, default=4, help="k (default: 4)"
    )
    parser.add_argument("--steps", type=int, default=64, help="new tokens per request")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default: 32)")
    parser.add_argument(
        "--warmup-tokens", type=int, default=48, help="run-ahead of repeating prompts"
    )
    parser.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    parser.add_argument(
        "--workloads", default="repeating,novel", help="comma-separated (default: both)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default: 1: on a shared machine more threads than free cores "
        "slow every step many times over, and the ratios with them)",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default=None,
        help="cpu: the process's CPU seconds (with one thread, unaffected by other load; "
        "default on CPU); wall: elapsed seconds, the device synchronized before each reading "
        "(default, and the only meaningful one, on CUDA)",
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu (default), cuda or cuda:N: target and draft"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="weights and KV cache of target and draft (default: float32)",
    )
    parser.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="the engines' compiled decode (auto: on for CUDA, off on CPU; see --compile of "
        "`pdserve serve`)",
    )
    parser.add_argument(
        "--prompt-kv",
        default=None,
        metavar="LENGTHS",
        help="instead: the draft's prompt forward vs sending its KV, per prompt length "
        "(spec_prompt_kv.py)",
    )
    parser.add_argument(
        "--transfer-gbps",
        type=float,
        default=0.52,
        help="KV transfer rate for --prompt-kv (default: 0.52, the grpc transport's measured "
        "GB/s on loopback, BENCHMARKS.md)",
    )


@dataclass
class Measured:
    rate: float  # decode tokens/s (median of the repeats)
    step_seconds: float  # median decode step
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    tokens: int = 0  # decode tokens of the measured runs
    outputs: list[list[int]] | None = None  # prompt + output of the last run


def run(args: argparse.Namespace) -> int:
    import torch

    if args.steps < 4:
        raise SystemExit("--steps must be at least 4")
    if args.model and args.residual_scale is not None:
        raise SystemExit("--residual-scale writes the preset: drop --model")
    if args.residual_scale is not None and not 0.0 < args.residual_scale <= 1.0:
        raise SystemExit(f"--residual-scale must be in (0, 1], got {args.residual_scale}")
    if args.clock is None:
        args.clock = "cpu" if args.device == "cpu" else "wall"
    if args.clock == "cpu" and args.device != "cpu":
        raise SystemExit("--clock cpu measures nothing of a CUDA device's work: use wall")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        _run(args)
    finally:
        torch.set_num_threads(threads)
    return 0


def _run(args: argparse.Namespace) -> None:
    from pdserve.models.builtin import builtin_model_dir, write_model
    from pdserve.models.draft_of import write_draft_of
    from pdserve.models.presets import preset_config

    batches = [int(b) for b in args.batch_sizes.split(",")]
    workloads = args.workloads.split(",")
    k = args.num_speculative_tokens
    with tempfile.TemporaryDirectory(prefix="pdserve-spec-bench-") as tmp:
        if args.model:
            target = args.model
        elif args.residual_scale is None:
            target = str(builtin_model_dir(args.preset))
        else:
            config = preset_config(args.preset)
            target = str(
                write_model(Path(tmp) / "target", config, 0, residual_scale=args.residual_scale)
            )
            print(f"target: the {args.preset} preset, residual scale {args.residual_scale:g}")
        draft = args.draft_model
        if draft is None:
            draft = str(write_draft_of(target, Path(tmp) / "draft", args.draft_layers)[0])
        if args.prompt_kv:
            from pdserve.bench.decoding.spec_prompt_kv import report

            lengths = [int(n) for n in args.prompt_kv.split(",")]
            report(args, target, draft, lengths, clock_of(args))
            return
        prompts, hit_rate = _workloads(args, target, max(batches), workloads)
        print(
            f"target {target}, draft {draft}, k={k}, {args.steps} new tokens per request, "
            f"{args.device} {args.dtype}, {args.clock} clock"
        )
        if "repeating" in prompts:
            print(f"repeating prompts: run-ahead lookup hit rate {hit_rate:.2f}")
        print(
            f"{'workload':>10} {'batch':>5} {'mode':>6} {'tok/s':>8} {'speedup':>8} "
            f"{'accept':>7} {'alpha':>6} {'c':>6} {'limit':>6} {'/limit':>7} "
            f"{'alpha*':>6} {'limit*':>6} {'/limit*':>7}"
        )
        for workload in workloads:
            for batch in batches:
                cell = prompts[workload][:batch]
                measured = _measure_cell(args, target, draft, cell)
                base = measured["off"]
                print(f"{workload:>10} {batch:>5} {'off':>6} {base.rate:8.1f} {1:8.2f}x")
                costs = {
                    "ngram": _ngram_cost(measured["ngram"], k, clock_of(args)) / base.step_seconds,
                    "draft": measured[DRAFT_ALONE].step_seconds / base.step_seconds,
                }
                for mode in ("ngram", "draft"):
                    m, c = measured[mode], costs[mode]
                    accept = m.accepted / m.drafted if m.drafted else 0.0
                    tokens_per_verify = 1 + (m.accepted / m.verifications if m.verifications else 0)
                    alpha = fit_alpha(tokens_per_verify, k)
                    limit = leviathan_limit(alpha, k, c)
                    speedup = m.rate / base.rate
                    per_step = m.tokens / max(m.tokens - m.accepted, 1)  # every decode step
                    alpha_all = fit_alpha(per_step, k)
                    limit_all = leviathan_limit(alpha_all, k, c)
                    print(
                        f"{workload:>10} {batch:>5} {mode:>6} {m.rate:8.1f} {speedup:8.2f}x "
                        f"{accept:7.2f} {alpha:6.2f} {c:6.3f} {limit:6.2f} {speedup / limit:7.2f} "
                        f"{alpha_all:6.2f} {limit_all:6.2f} {speedup / limit_all:7.2f}"
                    )
        print(TARGET_NOTE)


# Which limit the target (speedup >= 0.8 of Leviathan's limit) is read against.
TARGET_NOTE = """\
target: speedup / limit*. alpha* is the alpha whose Leviathan E[tokens per step],
(1 - alpha^(k+1)) / (1 - alpha), equals the measured tokens per sequence-step over every decode
step; with c ~ 0 (ngram) speedup / limit* = plain step time / mean step time, i.e. only what
verification itself costs. accept = accepted / drafted (the issue's a); alpha is fitted to the
tokens per verification assuming k drafts each, over verify steps only: steps without a
proposal are left out, and with the cost-aware length (fewer than k drafts) it reads low."""


def clock_of(args: argparse.Namespace) -> Callable[[], float]:
    """The benchmark's clock; on CUDA it first waits for the device's queued work, so a
    reading includes what the step launched."""
    read = CLOCKS[args.clock]
    if args.device == "cpu":
        return read
    import torch

    device = torch.device(args.device)

    def synchronized() -> float:
        torch.cuda.synchronize(device)
        return read()

    return synchronized


def leviathan_limit(alpha: float, k: int, c: float) -> float:
    """Expected speedup of speculative decoding (Leviathan et al. 2023, Theorem 3.8)."""
    return expected_tokens(alpha, k) / (1 + k * c)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification yields: (1 - alpha^(k+1)) / (1 - alpha); k + 1 at alpha 1."""
    return k + 1.0 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def fit_alpha(tokens_per_verification: float, k: int) -> float:
    """The alpha whose expected tokens per verification is the measured one (bisection)."""
    if tokens_per_verification >= k + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens(mid, k) < tokens_per_verification else (low, mid)
    return low


def _engine(args: argparse.Namespace, model: str, mode: str, draft: str | None, batch: int):
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine_config import EngineConfig, SpeculativeConfig

    longest = args.prompt_len + args.warmup_tokens + args.steps + args.num_speculative_tokens
    spec = SpeculativeConfig()
    if mode != "off":
        spec = SpeculativeConfig(
            method=mode,
            draft_model=draft if mode == "draft" else None,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    return LLMEngine(
        EngineConfig(
            model=model,
            device=args.device,
            dtype=args.dtype,
            compile={"auto": None, "on": True, "off": False}[args.compile],
            block_size=BLOCK_SIZE,
            num_kv_blocks=2 * batch * (-(-longest // BLOCK_SIZE) + 2),
            max_num_seqs=batch,
            max_num_batched_tokens=max(1024, batch * (longest + 1)),
            speculative=spec,
        )
    )


def _workloads(
    args: argparse.Namespace, target: str, count: int, names: list[str]
) -> tuple[dict[str, list[list[int]]], float]:
    from pdserve.bench.decoding.spec_workloads import novel_prompts, repeating_prompts

    prompts, hit_rate = {}, 0.0
    engine = _engine(args, target, "off", None, 2 * count)
    if "repeating" in names:
        prompts["repeating"], hit_rate = repeating_prompts(
            engine, count, args.prompt_len, args.warmup_tokens
        )
    if "novel" in names:
        prompts["novel"] = novel_prompts(count, args.prompt_len, engine.executor.vocab_size)
    unknown = set(names) - set(prompts)
    if unknown:
        raise SystemExit(f"--workloads: unknown {sorted(unknown)}; choose repeating, novel")
    return prompts, hit_rate


def _measure_cell(
    args: argparse.Namespace, target: str, draft: str, prompts: list[list[int]]
) -> dict[str, Measured]:
    """Every mode on the same prompts, plus a plain engine on the draft model (its decode step
    is the draft's cost): fresh engines, one warm-up run each, then the measured runs in
    rotation, so a change in the machine's load hits every mode alike."""
    clock = clock_of(args)
    engines = {mode: _engine(args, target, mode, draft, len(prompts)) for mode in MODES}
    engines[DRAFT_ALONE] = _engine(args, draft, "off", None, len(prompts))
    for engine in engines.values():
        _decode(engine, prompts, 8, clock)
    before = {name: engine.stats() for name, engine in engines.items()}
    runs: dict[str, list] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            runs[name].append(_decode(engine, prompts, args.steps, clock))
    measured = {}
    for name, engine in engines.items():
        after, earlier = engine.stats(), before[name]
        rates = [tokens / seconds for tokens, seconds, _, _ in runs[name]]
        measured[name] = Measured(
            rate=statistics.median(rates),
            step_seconds=statistics.median(s for run in runs[name] for s in run[2]),
            drafted=after["spec_draft_tokens"] - earlier["spec_draft_tokens"],
            accepted=after["spec_accepted_tokens"] - earlier["spec_accepted_tokens"],
            verifications=after["spec_verify_steps"] - earlier["spec_verify_steps"],
            tokens=sum(run[0] for run in runs[name]),
            outputs=runs[name][-1][3],
        )
    return measured


def _decode(
    engine: Any, prompts: list[list[int]], new_tokens: int, clock: Callable[[], float]
) -> tuple[int, float, list[float], list[list[int]]]:
    """(decode tokens, their seconds, each decode step's seconds, prompt + output per request):
    the span from every request having its first token to the last request's end."""
    from pdserve.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    base = engine.stats()["steps"]
    ids = [f"spec-{base}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    while any(not tokens for tokens in outputs.values()):
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    start = clock()
    step_seconds = []
    while engine.has_unfinished():
        began = clock()
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        step_seconds.append(clock() - began)
    seconds = clock() - start
    tokens = sum(len(o) - 1 for o in outputs.values())
    return (
        tokens,
        seconds,
        step_seconds,
        [p + outputs[r] for p, r in zip(prompts, ids, strict=True)],
    )


def _ngram_cost(measured: Measured, k: int, clock: Callable[[], float]) -> float:
    """Seconds prompt lookup takes for one step of the batch (the final sequences, median)."""
    from pdserve.engine.speculation.ngram_proposer import lookup

    sequences = measured.outputs or []
    times = []
    for _ in range(5):
        began = clock()
        for tokens in sequences:
            lookup(tokens, k, 3, 1)
        times.append(clock() - began)
    return statistics.median(times)
