"""`pdserve bench router`: the cost policy against round-robin, same system, same workloads.

    pdserve bench router --preset small

For each policy the system is started once (2 prefill + 2 decode workers, each pinned to a
core) and serves two workloads in turn, each as an open-loop Poisson stream:
  shared-prefix  groups of prompts sharing a system prompt (SGLang's generated-shared-prefix);
  mixed          long prompts among short chats.
Reported per workload and policy: prompt tokens the workers actually computed (sum of the
`WorkerStats.prefill_tokens` deltas) against the minimum any policy could reach (every distinct
full block computed once, plus each prompt's unshareable tail), the prefix hit rate, TTFT p50/p99
and TPOT p99, and the cost policy's ratios to round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.common.local_system import (
    add_mixed_arguments,
    add_model_arguments,
    eos_ids,
    load_model,
    mixed_requests,
    serve_locally,
    wait_idle,
)

POLICIES = ("cost", "round_robin")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, preset="small")
    p.add_argument("--seed", type=int, default=0)
    # A chat-like TTFT target for this workload on one CPU core per worker (a 32-token prefill
    # with a cached prefix takes ~100 ms here); with 1000 ms the policy has no reason to trade.
    p.add_argument("--ttft-slo-ms", type=float, default=200.0, help="the cost policy's target")
    p.add_argument("--tpot-slo-ms", type=float, default=100.0, help="the cost policy's target")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="token budget per engine step (the prefill chunk size)",
    )
    gsp = p.add_argument_group("shared-prefix workload")
    # Many system prompts, each reused a few times (multi-tenant traffic): where routing decides
    # whether a request finds its prefix. With few groups and many prompts each, every worker
    # soon caches every prefix and round-robin misses only its first request per group and worker.
    gsp.add_argument("--groups", type=int, default=24)
    gsp.add_argument("--prompts-per-group", type=int, default=3)
    gsp.add_argument("--system-prompt-len", type=int, default=256)
    gsp.add_argument("--question-len", type=int, default=32)
    gsp.add_argument("--gsp-output-len", type=int, default=8)
    gsp.add_argument("--gsp-rate", type=float, default=2.0, help="requests/s")
    mixed = p.add_argument_group("mixed workload")
    mixed.add_argument("--mixed-requests", type=int, default=24)
    add_mixed_arguments(
        mixed, long_fraction=0.25, long_input=768, long_output=8, short_input=64, short_output=24
    )
    mixed.add_argument("--mixed-rate", type=float, default=1.5, help="requests/s")
    p.add_argument("--json", help="write every result to this file")


@dataclasses.dataclass
class WorkloadResult:
    """One workload under one policy."""

    completed: int
    failed: int
    prompt_tokens: int
    computed_tokens: int  # prompt tokens the workers actually ran through the model
    minimum_tokens: int  # the least any routing could compute for this workload
    cached_tokens: int  # prompt tokens served from a prefix cache (client-reported)
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    routes: dict[str, int]  # prefill worker -> requests it prefilled

    @property
    def computed_vs_minimum(self) -> float:
        return self.computed_tokens / max(1, self.minimum_tokens)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)


def minimum_prefill_tokens(prompts: Sequence[list[int]], block_size: int) -> int:
    """Every distinct full block computed once (chained hashes: equal hash = equal prefix),
    plus each prompt's partial tail block, and at least one token per prompt: the last prompt
    token always runs, to sample the first output token, so a prompt that ends on a block
    boundary recomputes a token when another prompt already computed its last block."""
    from pdserve.core.block_hash import prompt_block_hashes

    hashes = [prompt_block_hashes(prompt, block_size) for prompt in prompts]
    interior = {h for chain in hashes for h in chain[:-1]}
    blocks = {h for chain in hashes for h in chain}
    finals: set[int] = set()
    tails = 0
    for prompt, chain in zip(prompts, hashes, strict=True):
        tail = len(prompt) % block_size
        if tail or not chain:
            tails += max(1, tail)
            continue
        tails += chain[-1] in interior or chain[-1] in finals
        finals.add(chain[-1])
    return len(blocks) * block_size + tails


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    model_dir, model_config = load_model(args)
    workloads = _workloads(args, model_config)
    console = Console(width=150)
    for name, (requests, rate) in workloads.items():
        prompts = [r.prompt for r in requests]
        console.print(
            f"{name}: {len(requests)} requests at {rate:g}/s, "
            f"{sum(r.prompt_len for r in requests)} prompt tokens, minimum computed "
            f"{minimum_prefill_tokens(prompts, args.block_size)}"
        )
    results: dict[str, dict[str, WorkloadResult]] = {}
    for policy in POLICIES:
        console.print(f"[bold]{policy}[/bold]: starting the system")
        started = time.perf_counter()
        with _serve(policy, model_dir, args) as app:
            console.print(f"  started in {time.perf_counter() - started:.1f}s; warming up")
            _warm_up(app, model_config, args)
            results[policy] = {}
            for name, (requests, rate) in workloads.items():
                result = _measure(app, requests, rate, args)
                results[policy][name] = result
                console.print(f"  {name}: {_line(result)}")
    console.print(_table(results, workloads))
    if args.json:
        document = {
            policy: {
                name: dataclasses.asdict(r)
                | {"computed_vs_minimum": r.computed_vs_minimum, "hit_rate": r.hit_rate}
                for name, r in by_workload.items()
            }
            for policy, by_workload in results.items()
        }
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    failed = sum(r.failed for by in results.values() for r in by.values())
    return 1 if failed else 0


def _workloads(args: argparse.Namespace, model_config: dict) -> dict[str, tuple[list, float]]:
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    vocab, eos = model_config["vocab_size"], eos_ids(model_config)
    gsp = DatasetConfig(
        name="shared-prefix",
        gsp_num_groups=args.groups,
        gsp_prompts_per_group=args.prompts_per_group,
        gsp_system_prompt_len=args.system_prompt_len,
        gsp_question_len=args.question_len,
        gsp_output_len=args.gsp_output_len,
    )
    num_gsp = args.groups * args.prompts_per_group
    return {
        "shared-prefix": (generate_requests(gsp, num_gsp, args.seed, vocab, eos), args.gsp_rate),
        # Another seed: the mixed prompts share nothing with the shared-prefix ones.
        "mixed": (
            mixed_requests(args, model_config, args.mixed_requests, args.seed + 1),
            args.mixed_rate,
        ),
    }


def _serve(policy: str, model_dir: Path, args: argparse.Namespace):
    engine = {"block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens}
    return serve_locally(
        model_dir,
        prefill_workers=2,
        decode_workers=2,
        engine=engine,
        router={"policy": policy, "ttft_slo_ms": args.ttft_slo_ms, "tpot_slo_ms": args.tpot_slo_ms},
    )


def _warm_up(app, model_config: dict, args: argparse.Namespace) -> None:
    """Unshared prompts through every worker, so first-call costs stay out of the figures and
    the cost model has measured the workers before the first measured request."""
    from pdserve.bench.common.load_generator import run_load
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    warm = DatasetConfig(name="random", random_input_len=128, random_output_len=4)
    requests = generate_requests(
        warm, 8, args.seed + 2, model_config["vocab_size"], eos_ids(model_config)
    )
    asyncio.run(run_load(f"127.0.0.1:{app.port}", requests, max_concurrency=2))
    wait_idle(app)


def _measure(app, requests: list, rate: float, args: argparse.Namespace) -> WorkloadResult:
    from pdserve.bench.common.load_generator import run_load
    from pdserve.workloads.metrics import run_duration, summarize

    before = _prefill_tokens(app)
    records = asyncio.run(
        run_load(f"127.0.0.1:{app.port}", requests, request_rate=rate, seed=args.seed)
    )
    wait_idle(app)
    computed = _prefill_tokens(app) - before
    summary = summarize(records, run_duration(records) or 1e-9)
    routes: dict[str, int] = {}
    for record in records:
        worker = record.server_timings.get("prefill_worker", "") or "?"
        routes[worker] = routes.get(worker, 0) + 1
    return WorkloadResult(
        completed=summary.completed,
        failed=summary.failed,
        prompt_tokens=sum(r.prompt_len for r in records),
        computed_tokens=computed,
        minimum_tokens=minimum_prefill_tokens([r.prompt for r in requests], args.block_size),
        cached_tokens=sum(r.cached_prompt_tokens for r in records if r.ok),
        ttft_p50_ms=summary.ttft.p50,
        ttft_p99_ms=summary.ttft.p99,
        tpot_p99_ms=summary.tpot.p99,
        routes=dict(sorted(routes.items())),
    )


def _prefill_tokens(app) -> int:
    import ray

    workers = app.app.pool.workers.values()
    return sum(s.prefill_tokens for s in ray.get([w.actor.stats.remote() for w in workers]))


def _line(r: WorkloadResult) -> str:
    return (
        f"computed {r.computed_tokens} tokens ({r.computed_vs_minimum:.2f}x minimum), "
        f"hit rate {r.hit_rate:.0%}, TTFT p50 {r.ttft_p50_ms:.0f} ms p99 "
        f"{r.ttft_p99_ms:.0f} ms, TPOT p99 {r.tpot_p99_ms:.0f} ms, failed {r.failed}, "
        f"prefills {r.routes}"
    )


def _table(results: dict[str, dict[str, WorkloadResult]], workloads: dict[str, Any]):
    from rich.table import Table

    table = Table(title="Routing policy vs round-robin (ratios: cost / round_robin)")
    columns = (
        "workload",
        "policy",
        "prefill computed",
        "vs minimum",
        "hit rate",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p99 ms",
        "failed",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in columns[:2] else "right")
    for name in workloads:
        for policy in POLICIES:
            r = results[policy][name]
            table.add_row(
                name,
                policy,
                str(r.computed_tokens),
                f"{r.computed_vs_minimum:.2f}x",
                f"{r.hit_rate:.0%}",
                f"{r.ttft_p50_ms:.0f}",
                f"{r.ttft_p99_ms:.0f}",
                f"{r.tpot_p99_ms:.0f}",
                str(r.failed),
            )
        c, b = results["cost"][name], results["round_robin"][name]
        table.add_row(
            name,
            "ratio",
            _ratio(c.computed_tokens, b.computed_tokens),
            "",
            _ratio(c.hit_rate, b.hit_rate),
            _ratio(c.ttft_p50_ms, b.ttft_p50_ms),
            _ratio(c.ttft_p99_ms, b.ttft_p99_ms),
            _ratio(c.tpot_p99_ms, b.tpot_p99_ms),
            "",
        )
        table.add_section()
    return table


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"
