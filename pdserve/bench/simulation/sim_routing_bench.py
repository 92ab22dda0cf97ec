"""`pdserve bench sim-routing`: routing policies on 16 and 64 simulated GPUs (issue 14 point 5b).

    pdserve bench sim-routing --sizes 16,64

For each cluster size N the system is started once: N sim workers on the analytical H100
profile with Llama-3.1-8B's shape (bf16; each with the KV pool an 80 GB H100 holds after the
weights), a quarter of them prefill workers (`--prefill-fraction`), `disaggregate=auto`. The
policies are swapped in place (`sim_run.set_routing`, learned costs kept) and each serves its
own multi-turn chat workload (same shape, its own tokens, so no policy finds another's
prefixes): `4 x N` conversations (`--conversations-per-worker`) of `--turns` turns, each opening
with one of `--system-prompts` shared system prompts; a turn's prompt is the previous prompt +
the answer + a new user message, every conversation's turn k is sent before any turn k+1. The
offered rate is `--rate-per-worker x N` simulated requests/s (Poisson).

Reported per size and policy, in simulated time: TTFT p50/p99, TPOT p50/p99, prompt tokens
the workers computed (the `WorkerStats.prefill_tokens` deltas of every worker) against the
minimum any routing could reach (`minimum_prefill_tokens`), and the ratios to round-robin: TTFT p50 (target <= 0.5),
TPOT p99 (target <= 1.0). Every run passes the saturation check or the bench stops with its
refusal.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.bench.simulation.sim_run import (
    add_cluster_arguments,
    cluster_from_args,
    local_prefill_fraction,
    run_sim_load,
    serve_sim,
    set_routing,
    sim_workers,
    wait_idle,
)
from pdserve.bench.simulation.sim_saturation import Saturated, checked_run

POLICIES = ("round_robin", "least_loaded", "prefix", "cost")


@dataclass
class PolicyResult:
    """One policy on one cluster size, in simulated time."""

    size: int
    policy: str
    completed: int
    failed: int
    prompt_tokens: int
    computed_tokens: int
    minimum_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    local_prefills: float  # fraction of completed requests prefilled on their decode worker
    # This process's CPU seconds per wall second during the run, and the worst worker's step
    # time over its model: the saturation check's figures (None offline: no wall clock).
    router_busy: float | None
    max_step_excess: float | None

    @property
    def computed_vs_minimum(self) -> float:
        return self.computed_tokens / max(1, self.minimum_tokens)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_arguments(p, time_scale=40.0)
    p.add_argument("--sizes", default="16,64", help="cluster sizes (workers), comma separated")
    p.add_argument("--prefill-fraction", type=float, default=0.25, help="of each cluster")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--rate-per-worker", type=float, default=2.0, help="simulated req/s")
    p.add_argument("--conversations-per-worker", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-prompts", type=int, default=16)
    p.add_argument("--system-prompt-len", type=int, default=2048)
    p.add_argument("--user-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ttft-slo-ms", type=float, default=400.0, help="the cost policy's target")
    p.add_argument("--tpot-slo-ms", type=float, default=40.0, help="the cost policy's target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every result to this file")


def run(args: argparse.Namespace, measure_size_with=None) -> int:
    """`measure_size_with`: measures one size in place of the live system (same arguments as
    `measure_size` less the console; pdserve/bench/planner_validation/routing_offline.py passes the offline one)."""
    from rich.console import Console

    from pdserve.bench.simulation.sim_run import bench_error, config_only_model, ensure_ray

    sizes = [int(s) for s in args.sizes.split(",")]
    policies = [p.strip() for p in args.policies.split(",")]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        known = ", ".join(POLICIES)
        return bench_error(f"--policies: unknown {', '.join(unknown)} (known: {known})", 2)
    splits = {n: split(n, args.prefill_fraction) for n in sizes}
    model_dir = Path(args.model) if args.model else config_only_model()
    model_config = json.loads((model_dir / "config.json").read_text())
    console = Console(width=160)
    if measure_size_with is None:
        ensure_ray(max(p for p, _ in splits.values()), max(d for _, d in splits.values()))
    results: list[PolicyResult] = []
    for size in sizes:
        prefill, decode = splits[size]
        console.print(f"[bold]{size} workers[/bold]: {prefill} prefill + {decode} decode")
        if measure_size_with is not None:
            found = measure_size_with(model_dir, model_config, size, prefill, decode, policies,
                                      args)  # fmt: skip
            for result in found:
                console.print(f"  {result.policy}: {_line(result)}")
            results += found
            continue
        try:
            results += measure_size(model_dir, model_config, size, prefill, decode, policies,
                                    args, console)  # fmt: skip
        except Saturated as refused:
            return bench_error(str(refused), 3)
    console.print(report_table(results))
    for line in ratio_lines(results):
        console.print(line)
    if args.json:
        document = [asdict(r) | {"computed_vs_minimum": r.computed_vs_minimum} for r in results]
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 1 if any(r.failed for r in results) else 0


def minimum_prefill_tokens(prompts: Sequence[list[int]], block_size: int) -> int:
    """Prompt tokens computed by one worker with an unbounded prefix cache serving `prompts` in
    order: each prompt's full blocks not seen before, its partial tail, and one token for a
    prompt whose blocks were all seen (the last prompt token always runs). No routing over any
    number of workers computes less for this order of arrival."""
    from pdserve.core.block_hash import prompt_block_hashes

    seen: set[int] = set()
    total = 0
    for prompt in prompts:
        chain = prompt_block_hashes(prompt, block_size)
        new = sum(h not in seen for h in chain)
        seen.update(chain)
        tail = len(prompt) % block_size
        total += new * block_size + tail + (1 if not new and not tail else 0)
    return total


def split(size: int, prefill_fraction: float) -> tuple[int, int]:
    """(prefill, decode) workers of a cluster of `size`: at least one of each."""
    prefill = min(size - 1, max(1, round(size * prefill_fraction)))
    return prefill, size - prefill


def workload(args: argparse.Namespace, size: int, model_config: dict, seed: int):
    from pdserve.bench.common.local_system import eos_ids
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    config = DatasetConfig(
        name="multi-turn",
        mt_conversations=args.conversations_per_worker * size,
        mt_turns=args.turns,
        mt_system_prompts=args.system_prompts,
        mt_system_prompt_len=args.system_prompt_len,
        mt_user_len=args.user_len,
        mt_output_len=args.output_len,
    )
    count = config.mt_conversations * config.mt_turns
    return generate_requests(config, count, seed, model_config["vocab_size"], eos_ids(model_config))


def warm_up_requests(args: argparse.Namespace, size: int, model_config: dict):
    """Unshared prompts sent through the workers first, so the cost model has measured them."""
    from pdserve.bench.common.local_system import eos_ids
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    warm = DatasetConfig(name="random", random_input_len=512, random_output_len=8)
    return generate_requests(
        warm, 2 * size, args.seed + 999, model_config["vocab_size"], eos_ids(model_config)
    )


def measure_size(
    model_dir: Path,
    model_config: dict,
    size: int,
    prefill: int,
    decode: int,
    policies: list[str],
    args: argparse.Namespace,
    console,
) -> list[PolicyResult]:

    cluster = cluster_from_args(
        args,
        prefill_workers=prefill,
        decode_workers=decode,
        disaggregate="auto",
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
    )
    results = []
    with serve_sim(model_dir, cluster, model_config) as app:
        rate = args.rate_per_worker * size
        warm_requests = warm_up_requests(args, size, model_config)
        run_sim_load(app, warm_requests, rate, cluster.time_scale, seed=args.seed)
        wait_idle(app)
        for i, policy in enumerate(policies):
            set_routing(app, policy)

            def requests_of(attempt: int, seed: int = args.seed + 1 + i):
                # Each policy (and a retry) gets its own prompts: none finds another's prefixes.
                return workload(args, size, model_config, seed + 100 * attempt)

            result = measure_policy(app, size, policy, requests_of, rate, cluster.time_scale, args)
            results.append(result)
            console.print(f"  {policy}: {_line(result)}")
    return results


def measure_policy(app, size: int, policy: str, requests_of, rate: float, scale: float, args):
    """One policy's run (`requests_of(attempt)` its workload); raises Saturated if refused."""

    sent: dict = {}

    def attempt_at(attempt: int):
        sent["requests"] = requests_of(attempt)
        sent["before"] = sum(s.prefill_tokens for s in sim_workers(app).values())
        return run_sim_load(app, sent["requests"], rate, scale, seed=args.seed + attempt)

    records, check = checked_run(app, args, attempt_at, f"{size} workers / {policy}")
    requests = sent["requests"]
    computed = sum(s.prefill_tokens for s in sim_workers(app).values()) - sent["before"]
    return policy_result(
        size, policy, records, requests, computed, local_prefill_fraction(records), args,
        router_busy=check.router_busy, max_step_excess=check.summary()["max_excess"],
    )  # fmt: skip


def policy_result(
    size: int,
    policy: str,
    records: Sequence,
    requests: Sequence,
    computed: int,
    local_prefills: float,
    args: argparse.Namespace,
    router_busy: float | None = None,
    max_step_excess: float | None = None,
) -> PolicyResult:
    """One policy's figures from its records (simulated time) and the prompt tokens computed."""
    from pdserve.workloads.metrics import run_duration, summarize

    summary = summarize(records, run_duration(records))
    return PolicyResult(
        size=size,
        policy=policy,
        completed=summary.completed,
        failed=summary.failed,
        prompt_tokens=sum(r.prompt_len for r in records),
        computed_tokens=computed,
        minimum_tokens=minimum_prefill_tokens([r.prompt for r in requests], args.block_size),
        ttft_p50_ms=summary.ttft.p50,
        ttft_p99_ms=summary.ttft.p99,
        tpot_p50_ms=summary.tpot.p50,
        tpot_p99_ms=summary.tpot.p99,
        local_prefills=local_prefills,
        router_busy=router_busy,
        max_step_excess=max_step_excess,
    )


def _line(r: PolicyResult) -> str:
    return (
        f"TTFT p50 {r.ttft_p50_ms:.1f} ms p99 {r.ttft_p99_ms:.1f} ms, TPOT p50 "
        f"{r.tpot_p50_ms:.1f} ms p99 {r.tpot_p99_ms:.1f} ms, computed {r.computed_tokens} "
        f"({r.computed_vs_minimum:.2f}x minimum), local prefills {r.local_prefills:.0%}, "
        f"failed {r.failed}"
        + ("" if r.router_busy is None else f", router busy {r.router_busy:.0%}")
        + ("" if r.max_step_excess is None else f", worst step excess {r.max_step_excess:+.1%}")
    )


def _baseline(results: list[PolicyResult], r: PolicyResult) -> PolicyResult | None:
    return next((b for b in results if b.size == r.size and b.policy == "round_robin"), None)


def report_table(results: list[PolicyResult]):
    from rich.table import Table

    table = Table(title="Routing policies on sim H100s, multi-turn chat (simulated time)")
    columns = ("workers", "policy", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
               "computed / minimum", "local prefills", "TTFT p50 / RR", "TPOT p99 / RR",
               "failed")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        base = _baseline(results, r)
        table.add_row(
            str(r.size),
            r.policy,
            f"{r.ttft_p50_ms:.1f}",
            f"{r.ttft_p99_ms:.1f}",
            f"{r.tpot_p50_ms:.1f}",
            f"{r.tpot_p99_ms:.1f}",
            f"{r.computed_vs_minimum:.2f}x",
            f"{r.local_prefills:.0%}",
            _ratio(r.ttft_p50_ms, base.ttft_p50_ms) if base else "-",
            _ratio(r.tpot_p99_ms, base.tpot_p99_ms) if base else "-",
            str(r.failed),
        )
    return table


def ratio_lines(results: list[PolicyResult]) -> list[str]:
    """The cost policy against the targets, one line per size."""
    lines = []
    for r in results:
        base = _baseline(results, r)
        if r.policy != "cost" or base is None:
            continue
        lines.append(
            f"{r.size} workers, cost vs round-robin: TTFT p50 "
            f"{_ratio(r.ttft_p50_ms, base.ttft_p50_ms)} (target <= 0.5), prefill computed "
            f"{r.computed_vs_minimum:.2f}x minimum (target <= 1.1), TPOT p99 "
            f"{_ratio(r.tpot_p99_ms, base.tpot_p99_ms)} (target <= 1.0)"
        )
    return lines


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"
