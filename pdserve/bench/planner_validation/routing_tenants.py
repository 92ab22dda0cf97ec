"""`pdserve bench sim-routing-offline --workload tenants`: the regime where prefix-aware routing
decides everything (issue 50). T tenants, each with a long shared prefix (a system prompt or
document), about U users per tenant asking short questions over several turns (each turn's
prompt: the prefix, the conversation so far, a new question; every user's turn k before any
turn k+1); T chosen so that all prefixes together need `--prefix-kv-fraction` of the cluster's
KV, which is many times one worker's. Six policies side by side, each on a fresh virtual
cluster per load: Poisson rates swept from light to well past round-robin's saturation (open
loop, `--rates-per-worker`), or clients that wait for their answers (closed loop,
`--concurrency`: pdserve/planner/closed_loop.py).

Colocated workers (`disaggregate=never`: every worker prefills what it decodes, the setting of
llm-d's and Dynamo's prefix-cache routing results). The event-fed policies (`cost`, `prefix`)
see the router's copy of the index as a VirtualIndex fed by the workers' KV events
`--index-lag-ms` after each step (plus the router's recent routes, as live); `approximate` sees
only its own prediction; the others no cache at all.

Reported per model, size, rate and policy (simulated time): completed and failed requests,
TTFT p50/p90, output tokens/s (completed requests' tokens over the run), goodput (the output
tokens/s of the requests that met both SLOs, `--ttft-slo-ms` and `--tpot-slo-ms`), prefix hit
rate (1 - prompt tokens the workers computed / prompt tokens sent); then issue 50's targets at
the highest rate where random still completes every request. Below saturation every policy
delivers the offered load, so output tokens/s can only tie there; what random loses first, as
its queues grow, is the requests served in time, which goodput counts. In the closed loop,
where the published throughput gains are measured, output tokens/s follows each request's
latency; the report ends with cost/random output tokens/s per concurrency against 1.5.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_RATES_PER_WORKER = "1,2,4,8,16"
TENANT_POLICIES = ("cost", "prefix", "approximate", "least_loaded", "round_robin", "random")
# A request that finds no room waits, then fails, as live; at these rates the run is short
# enough that a failure means the cluster could not keep up.


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=("multi-turn", "tenants"), default="multi-turn",
                   help="tenants: issue 50's multi-tenant sweep (the options below)")  # fmt: skip
    p.add_argument("--models", default="llama-3.1-8b:1,qwen2.5-32b:2",
                   help="tenants: shape:tp, comma separated (analytical profile of --gpu; with "
                   "a measured --sim-profile FILE.json, the model directory it was measured "
                   "on)")  # fmt: skip
    p.add_argument("--gpu", default="h100", help="tenants: the virtual GPU")
    p.add_argument("--rates-per-worker", default=None,
                   help="tenants: open loop, Poisson arrivals: simulated req/s per worker, "
                   f"comma separated (default {DEFAULT_RATES_PER_WORKER})")  # fmt: skip
    p.add_argument("--concurrency", default=None,
                   help="tenants: closed loop instead of --rates-per-worker: clients per worker, "
                   "comma separated; each waits for its answer before sending its next request "
                   "and owns whole conversations (pdserve/planner/closed_loop.py)")  # fmt: skip
    p.add_argument("--think-ms", type=float, default=0.0,
                   help="tenants, --concurrency: a client's pause between an answer and its "
                   "next request")  # fmt: skip
    p.add_argument("--tenant-prefix-len", type=int, default=4096, help="tenants: prefix tokens")
    p.add_argument("--users-per-tenant", type=int, default=4)
    p.add_argument("--tenant-turns", type=int, default=3)
    p.add_argument("--question-len", type=int, default=64, help="tenants: tokens per question")
    p.add_argument("--answer-len", type=int, default=64, help="tenants: tokens per answer")
    p.add_argument("--prefix-kv-fraction", type=float, default=0.7,
                   help="tenants: all prefixes' KV over the cluster's")  # fmt: skip
    p.add_argument("--tenant-kv-blocks", type=int, default=2048,
                   help="tenants: each worker's KV pool in blocks (scaled down from a GPU's)")  # fmt: skip
    p.add_argument("--router-replicas", type=int, default=1,
                   help="tenants: routers side by side, requests spread over them in turn; each "
                   "remembers only its own routes, all read the same index")  # fmt: skip
    p.add_argument("--index-lag-ms", type=float, default=1.0,
                   help="tenants: the router's copy of the index this far behind each step")  # fmt: skip


@dataclass
class TenantResult:
    model: str
    size: int
    rate: float  # simulated req/s, the whole cluster
    policy: str
    tenants: int
    requests: int
    completed: int
    failed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    output_tokens_per_s: float
    goodput_tokens_per_s: float  # output tokens/s of the requests within both SLOs
    hit_rate: float
    index_lag_ms: float
    # The index's traffic and size: KV events and the blocks they name per worker per second,
    # (block, worker) entries at most.
    index_events_per_worker_s: float
    index_blocks_per_worker_s: float
    index_peak_entries: int
    router_replicas: int = 1  # routers side by side, each remembering only its own routes
    # Closed loop (--concurrency): the clients, the whole cluster, and their pause between an
    # answer and the next request; `rate` is then the requests sent over the run's duration.
    # 0: open loop, Poisson arrivals at `rate`.
    concurrency: int = 0
    think_ms: float = 0.0


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdserve.bench.simulation.sim_run import bench_error

    console = Console(width=170)
    policies = [p.strip() for p in args.policies.split(",")]
    if args.policies == "round_robin,least_loaded,prefix,cost":  # sim-routing's own default
        policies = list(TENANT_POLICIES)
    unknown = sorted(set(policies) - set(TENANT_POLICIES))
    if unknown:
        return bench_error(f"--policies: unknown {', '.join(unknown)}", 2)
    if args.concurrency is not None and args.rates_per_worker is not None:
        return bench_error(
            "--concurrency (closed loop) and --rates-per-worker (open loop) are two arrival "
            "modes: give one of them",
            2,
        )
    if args.concurrency is not None:
        try:
            if min(int(c) for c in args.concurrency.split(",")) < 1:
                raise ValueError
        except ValueError:
            return bench_error(
                f"--concurrency: clients per worker, positive integers; got {args.concurrency!r}", 2
            )
        if args.think_ms < 0:
            return bench_error(f"--think-ms must be >= 0, got {args.think_ms:g}", 2)
    results: list[TenantResult] = []
    for spec in args.models.split(","):
        shape, _, tp = spec.partition(":")
        for size in (int(s) for s in args.sizes.split(",")):
            results += measure(shape, int(tp or 1), size, policies, args, console)
    for line in target_lines(results) + closed_loop_target_lines(results):
        console.print(line)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0


def measure(shape: str, tp: int, size: int, policies, args, console) -> list[TenantResult]:
    from pdserve.planner.deployment import Deployment

    # A measured profile (`bench fidelity --profile-out`) times the model it was measured on,
    # named in --models; otherwise --gpu's analytical one.
    measured = not args.sim_profile.startswith("analytical:")
    deployment = Deployment(
        shape,
        gpu=args.gpu,
        tp=tp,
        profile=args.sim_profile if measured else None,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.tenant_kv_blocks,
    )
    pool = args.tenant_kv_blocks
    prefix_blocks = args.tenant_prefix_len // args.block_size
    tenants = max(1, round(args.prefix_kv_fraction * size * pool / prefix_blocks))
    model = f"{shape} tp{tp}"
    console.print(
        f"[bold]{model}, {size} workers[/bold]: {tenants} tenants x {args.users_per_tenant} users"
        f" x {args.tenant_turns} turns; prefixes {tenants * prefix_blocks} blocks = "
        f"{tenants * prefix_blocks / (size * pool):.2f}x the cluster's KV, "
        f"{tenants * prefix_blocks / pool:.1f}x one worker's ({pool} blocks each); "
        f"{args.router_replicas} router(s)"
    )
    results = []
    # Every policy on the same requests (and arrival times): the comparison is the routing.
    requests = tenant_requests(deployment, tenants, args, seed=args.seed)
    if args.concurrency is not None:
        for per_worker in (int(c) for c in args.concurrency.split(",")):
            clients = per_worker * size
            for policy in policies:
                result = run_policy_closed_loop(
                    deployment, model, size, clients, policy, tenants, requests, args
                )
                results.append(result)
                console.print(
                    f"  {clients} clients ({result.rate:.1f} req/s) {policy}: {_line(result)}"
                )
        return results
    for per_worker in (
        float(r) for r in (args.rates_per_worker or DEFAULT_RATES_PER_WORKER).split(",")
    ):
        rate = per_worker * size
        for policy in policies:
            result = run_policy(deployment, model, size, rate, policy, tenants, requests, args)
            results.append(result)
            console.print(f"  {rate:g} req/s {policy}: {_line(result)}")
    return results


def tenant_requests(deployment, tenants: int, args, seed: int):
    special = deployment.tokenizer.eos_token_ids
    vocab = deployment.model_config["vocab_size"]
    return tenant_conversations(tenants, args, seed, vocab, special)


def tenant_conversations(tenants: int, args, seed: int, vocab_size: int, special_ids) -> list:
    """The tenants workload's requests: `tenants` shared prefixes, `users_per_tenant`
    conversations of `tenant_turns` each on every one (also the real-system bench's,
    pdserve/bench/serving/tenants_bench.py)."""
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    config = DatasetConfig(
        name="multi-turn",
        mt_conversations=tenants * args.users_per_tenant,
        mt_turns=args.tenant_turns,
        mt_system_prompts=tenants,
        mt_system_prompt_len=args.tenant_prefix_len,
        mt_user_len=args.question_len,
        mt_output_len=args.answer_len,
    )
    count = config.mt_conversations * config.mt_turns
    return generate_requests(config, count, seed, vocab_size, special_ids)


def run_policy(deployment, model, size, rate, policy, tenants, requests, args) -> TenantResult:
    from pdserve.bench.common.load_generator import arrival_times
    from pdserve.planner.probe import SLO, Split, run_probe
    from pdserve.planner.workload import ProbeRequest

    at = arrival_times(len(requests), rate, seed=args.seed)
    probes = [
        ProbeRequest(k, list(r.prompt), r.output_len, t * rate)
        for k, (r, t) in enumerate(zip(requests, at, strict=True))
    ]
    slo = SLO(args.ttft_slo_ms, args.tpot_slo_ms)
    _, runs = run_probe(
        deployment, Split(0, size), probes, rate, slo, _router(policy, args), stop_when_certain=False,
        index_lag_s=args.index_lag_ms / 1e3, router_replicas=args.router_replicas,
    )  # fmt: skip
    return _result(model, size, rate, policy, tenants, runs, args)


def run_policy_closed_loop(
    deployment, model, size, clients, policy, tenants, requests, args
) -> TenantResult:
    from pdserve.planner.closed_loop import run_closed_loop
    from pdserve.planner.probe import Split
    from pdserve.planner.workload import ProbeRequest
    from pdserve.workloads.metrics import run_duration

    probes = [
        ProbeRequest(k, list(r.prompt), r.output_len, 0.0, r.tag) for k, r in enumerate(requests)
    ]
    runs, _ = run_closed_loop(
        deployment, Split(0, size), probes, clients, _router(policy, args, clients),
        args.think_ms / 1e3,
        index_lag_s=args.index_lag_ms / 1e3, router_replicas=args.router_replicas,
    )  # fmt: skip
    sent = len(runs) / max(1e-9, run_duration([r.record for r in runs]))
    result = _result(model, size, sent, policy, tenants, runs, args)
    result.concurrency, result.think_ms = clients, args.think_ms
    return result


def _router(policy: str, args, clients: int = 0):
    """The router's settings; with `clients` (closed loop) its admission limit is raised to
    them, as a deployment sized for that many clients would set it: a closed loop never has
    more requests pending, and the default (256) would refuse the rest of a larger one at once,
    under every policy alike, each refusal freeing its client for the next."""
    from pdserve.config import RouterConfig

    config = RouterConfig(
        policy=policy,
        disaggregate="never",
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
    )
    config.max_pending_requests = max(config.max_pending_requests, clients)
    return config


def _result(model, size, rate, policy, tenants, runs, args) -> TenantResult:
    """The figures of one run, its requests' records and its cluster's workers and index."""
    from pdserve.workloads.metrics import run_duration, summarize

    records = [r.record for r in runs]
    summary = summarize(records, run_duration(records))
    workers = runs[0].cluster.workers.values()
    index = runs[0].cluster.index  # fed under every policy, as live workers always publish
    computed = sum(w.stats().prefill_tokens for w in workers)
    sent = sum(r.prompt_len for r in records if r.ok)
    done = [r for r in records if r.ok]
    in_slo = [
        r for r in done
        if r.ttft <= args.ttft_slo_ms / 1e3 and (r.tpot or 0.0) <= args.tpot_slo_ms / 1e3
    ]  # fmt: skip
    duration = max(1e-9, run_duration(records))
    return TenantResult(
        model=model,
        size=size,
        rate=rate,
        policy=policy,
        tenants=tenants,
        requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        ttft_p50_ms=summary.ttft.p50,
        ttft_p90_ms=summary.ttft.p90,
        tpot_p50_ms=summary.tpot.p50,
        output_tokens_per_s=sum(r.output_tokens for r in done) / duration,
        goodput_tokens_per_s=sum(r.output_tokens for r in in_slo) / duration,
        hit_rate=1.0 - computed / max(1, sent),
        index_lag_ms=args.index_lag_ms,
        index_events_per_worker_s=index.events / duration / size,
        index_blocks_per_worker_s=index.blocks / duration / size,
        index_peak_entries=index.peak_entries,
        router_replicas=args.router_replicas,
    )


def _line(r: TenantResult) -> str:
    return (
        f"TTFT p50 {r.ttft_p50_ms:.0f} p90 {r.ttft_p90_ms:.0f} ms, TPOT p50 {r.tpot_p50_ms:.1f} ms, "
        f"{r.output_tokens_per_s:.0f} output tok/s ({r.goodput_tokens_per_s:.0f} within SLO), "
        f"hit {r.hit_rate:.0%}, failed {r.failed}; index {r.index_events_per_worker_s:.0f} "
        f"events/s per worker, {r.index_peak_entries} entries at most"
    )


def target_lines(results: list[TenantResult]) -> list[str]:
    """Issue 50's targets per model and size, at the highest rate where random completes."""
    lines = []
    results = [r for r in results if not r.concurrency]  # open loop only
    groups = sorted({(r.model, r.size) for r in results})
    for model, size in groups:
        of = {(r.rate, r.policy): r for r in results if (r.model, r.size) == (model, size)}
        rates = sorted({rate for rate, _ in of})
        complete = [
            rate for rate in rates if (rate, "random") in of and not of[rate, "random"].failed
        ]
        head = f"{model}, {size} workers"
        if not complete or (complete[-1], "cost") not in of:
            lines.append(f"{head}: random failed at every rate (or cost not run)")
            continue
        rate = complete[-1]
        cost, rnd = of[rate, "cost"], of[rate, "random"]
        approx = of.get((rate, "approximate"))
        parts = [
            f"at {rate:g} req/s (random's highest complete): TTFT p90 cost/random "
            f"{cost.ttft_p90_ms / rnd.ttft_p90_ms:.3f} (target <= 0.1)",
        ]
        if approx:
            parts.append(f"cost/approximate {cost.ttft_p90_ms / approx.ttft_p90_ms:.2f} (<= 0.5)")
        parts.append(
            f"output tok/s cost/random {cost.output_tokens_per_s / rnd.output_tokens_per_s:.2f}, "
            f"within SLO {cost.goodput_tokens_per_s / max(1e-9, rnd.goodput_tokens_per_s):.2f}"
            " (>= 1.5)"
        )
        hits = ", ".join(
            f"{p} {of[rate, p].hit_rate:.0%}" for p in TENANT_POLICIES if (rate, p) in of
        )
        parts.append(f"hit rate {hits}")
        lowest = [
            r for r in rates
            if not of[r, "cost"].failed
            and of[r, "cost"].ttft_p90_ms > min(of[r, p].ttft_p90_ms for p in TENANT_POLICIES if (r, p) in of)
        ]  # fmt: skip
        parts.append(
            "cost's TTFT p90 the lowest at every rate it completes"
            if not lowest else f"cost's TTFT p90 NOT the lowest at {', '.join(f'{r:g}' for r in lowest)} req/s"
        )  # fmt: skip
        lines.append(f"{head}: " + "; ".join(parts))
    return lines


def closed_loop_target_lines(results: list[TenantResult]) -> list[str]:
    """Issue 50's throughput target in the closed loop, per model, size and concurrency: cost's
    output tokens/s at least 1.5x random's (with TTFT p90 cost/random beside it)."""
    lines = []
    closed = [r for r in results if r.concurrency]
    for model, size in sorted({(r.model, r.size) for r in closed}):
        of = {(r.concurrency, r.policy): r for r in closed if (r.model, r.size) == (model, size)}
        ratios = []
        for clients in sorted({c for c, _ in of}):
            if (clients, "cost") in of and (clients, "random") in of:
                cost, rnd = of[clients, "cost"], of[clients, "random"]
                output = cost.output_tokens_per_s / max(1e-9, rnd.output_tokens_per_s)
                ttft = cost.ttft_p90_ms / max(1e-9, rnd.ttft_p90_ms)
                ratios.append((clients, output, ttft))
        head = f"{model}, {size} workers, closed loop"
        if not ratios:
            lines.append(f"{head}: cost or random not run")
            continue
        parts = "; ".join(
            f"{c} clients: output tok/s cost/random {o:.2f}, TTFT p90 {t:.3f}" for c, o, t in ratios
        )
        held = [str(c) for c, o, _ in ratios if o >= 1.5]
        verdict = (
            f"target (>= 1.5) holds at {', '.join(held)} clients" if held else "target (>= 1.5) holds at none"
        )  # fmt: skip
        lines.append(f"{head}: {parts}; {verdict}")
    return lines
