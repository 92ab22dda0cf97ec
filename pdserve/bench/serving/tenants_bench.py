"""`pdserve bench router-tenants`: issue 50's multi-tenant workload on the real CPU system.

    pdserve bench router-tenants                     # 2 colocated workers, the `small` preset

`sim-routing-offline --workload tenants` scaled down to this machine: T tenants, each a shared
prefix, about U users per tenant asking short questions over several turns (the same generator,
routing_tenants.py); the workers' KV pools (`--kv-blocks`) sized so that all prefixes together
need `--prefix-kv-fraction` of the cluster's KV, more than one worker's. Each policy serves the
same requests at the same Poisson arrival times on a fresh system (real Ray workers, engines,
Redis index and the router's mirror of it; colocated workers, `disaggregate=never`, as in the
simulation), and the policies are ranked by TTFT p90, as the simulation ranks them.

Reported per policy: TTFT p50/p90, output tokens/s, the prefix hit rate the clients saw and the
prompt tokens the workers computed (their `prefill_tokens`), failed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

from pdserve.bench.common.local_system import (
    add_model_arguments,
    eos_ids,
    load_model,
    serve_locally,
    wait_idle,
)
from pdserve.bench.planner_validation.routing_tenants import TENANT_POLICIES

SETTING_TYPES = (str, int, float, bool, type(None))  # the flags' values (the CLI adds objects)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, preset="small")
    p.add_argument("--workers", type=int, default=2, help="colocated workers, each on a core")
    p.add_argument("--policies", default=",".join(TENANT_POLICIES))
    p.add_argument("--kv-blocks", type=int, default=128, help="each worker's KV pool in blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tenant-prefix-len", type=int, default=512)
    p.add_argument("--users-per-tenant", type=int, default=4)
    p.add_argument("--tenant-turns", type=int, default=3)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--answer-len", type=int, default=8)
    p.add_argument("--prefix-kv-fraction", type=float, default=0.7)
    p.add_argument("--rate", type=float, default=2.0, help="requests/s, Poisson")
    p.add_argument("--ttft-slo-ms", type=float, default=500.0, help="the cost policy's target")
    p.add_argument("--tpot-slo-ms", type=float, default=200.0, help="the cost policy's target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every result to this file")


@dataclasses.dataclass
class PolicyResult:
    policy: str
    completed: int
    failed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    output_tokens_per_s: float
    prompt_tokens: int  # sent, by the completed requests
    cached_tokens: int  # of them, served from a prefix cache (as the clients were told)
    computed_tokens: int  # prompt tokens the workers ran through the model

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)


def tenant_count(args: argparse.Namespace) -> int:
    prefix_blocks = args.tenant_prefix_len // args.block_size
    return max(1, round(args.prefix_kv_fraction * args.workers * args.kv_blocks / prefix_blocks))


def tenant_requests(args: argparse.Namespace, model_config: dict) -> list:
    from pdserve.bench.planner_validation.routing_tenants import tenant_conversations

    vocab = model_config["vocab_size"]
    return tenant_conversations(tenant_count(args), args, args.seed, vocab, eos_ids(model_config))


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdserve.bench.common.local_system import start_ray

    policies = [p.strip() for p in args.policies.split(",")]
    unknown = sorted(set(policies) - set(TENANT_POLICIES))
    if unknown:
        raise SystemExit(f"--policies: unknown {', '.join(unknown)}")
    model_dir, model_config = load_model(args)
    requests = tenant_requests(args, model_config)
    tenants, pool = tenant_count(args), args.workers * args.kv_blocks
    prefix_blocks = tenants * args.tenant_prefix_len // args.block_size
    console = Console(width=150)
    console.print(
        f"{args.workers} workers x {args.kv_blocks} KV blocks; {tenants} tenants x "
        f"{args.users_per_tenant} users x {args.tenant_turns} turns = {len(requests)} requests at "
        f"{args.rate:g}/s; prefixes {prefix_blocks} blocks = {prefix_blocks / pool:.2f}x the "
        f"cluster's KV, {prefix_blocks / args.kv_blocks:.1f}x one worker's"
    )
    import ray

    if not ray.is_initialized():  # a test's session cluster, else our own
        start_ray(0, args.workers)
    results = []
    for policy in policies:
        started = time.perf_counter()
        with _serve(policy, model_dir, args) as app:
            console.print(f"{policy}: started in {time.perf_counter() - started:.1f}s")
            _warm_up(app, model_config, args)
            result = _measure(app, policy, requests, args)
        results.append(result)
        console.print(f"  {_line(result)}")
    ranking = sorted(results, key=lambda r: (r.failed, r.ttft_p90_ms))
    console.print("ranking by TTFT p90: " + " < ".join(r.policy for r in ranking))
    if args.json:
        document = {
            "settings": {k: v for k, v in vars(args).items() if isinstance(v, SETTING_TYPES)}
            | {"tenants": tenants, "requests": len(requests)},
            "results": [dataclasses.asdict(r) | {"hit_rate": r.hit_rate} for r in results],
            "ranking": [r.policy for r in ranking],
        }
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 1 if any(r.failed for r in results) else 0


def _serve(policy: str, model_dir: Path, args: argparse.Namespace):
    engine = {"block_size": args.block_size, "num_kv_blocks": args.kv_blocks}
    router = {
        "policy": policy,
        "disaggregate": "never",
        "ttft_slo_ms": args.ttft_slo_ms,
        "tpot_slo_ms": args.tpot_slo_ms,
        # On a shared 2-core machine a worker can wait seconds for a core: that is not a dead
        # worker, and failing over from it would measure the machine, not the policy.
        "heartbeat_timeout_s": 30.0,
        "progress_timeout_s": 30.0,
    }
    return serve_locally(
        model_dir, prefill_workers=0, decode_workers=args.workers, engine=engine, router=router
    )


def _warm_up(app, model_config: dict, args: argparse.Namespace) -> None:
    """Unshared prompts through every worker first, so first-call costs stay out of the figures
    and the cost model has measured the workers."""
    from pdserve.bench.common.load_generator import run_load
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    warm = DatasetConfig(name="random", random_input_len=64, random_output_len=4)
    count = 4 * args.workers
    requests = generate_requests(
        warm, count, args.seed + 1, model_config["vocab_size"], eos_ids(model_config)
    )
    asyncio.run(run_load(f"127.0.0.1:{app.port}", requests, max_concurrency=args.workers))
    wait_idle(app)


def _measure(app, policy: str, requests: list, args: argparse.Namespace) -> PolicyResult:
    from pdserve.bench.common.load_generator import run_load
    from pdserve.workloads.metrics import run_duration, summarize

    before = _prefill_tokens(app)
    records = asyncio.run(
        run_load(f"127.0.0.1:{app.port}", requests, request_rate=args.rate, seed=args.seed)
    )
    wait_idle(app)
    summary = summarize(records, run_duration(records) or 1e-9)
    done = [r for r in records if r.ok]
    return PolicyResult(
        policy=policy,
        completed=summary.completed,
        failed=summary.failed,
        ttft_p50_ms=summary.ttft.p50,
        ttft_p90_ms=summary.ttft.p90,
        output_tokens_per_s=summary.output_throughput,
        prompt_tokens=sum(r.prompt_len for r in done),
        cached_tokens=sum(r.cached_prompt_tokens for r in done),
        computed_tokens=_prefill_tokens(app) - before,
    )


def _prefill_tokens(app) -> int:
    import ray

    workers = app.app.pool.workers.values()
    return sum(s.prefill_tokens for s in ray.get([w.actor.stats.remote() for w in workers]))


def _line(r: PolicyResult) -> str:
    return (
        f"TTFT p50 {r.ttft_p50_ms:.0f} ms p90 {r.ttft_p90_ms:.0f} ms, {r.output_tokens_per_s:.1f} "
        f"output tok/s, hit {r.hit_rate:.0%}, computed {r.computed_tokens} prompt tokens, "
        f"failed {r.failed}"
    )
