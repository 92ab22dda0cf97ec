"""`pdserve bench sim-routing-offline`: `bench sim-routing`'s comparison on the planner's virtual
cluster, same arguments (the live-only ones are ignored).

The live bench needs one Ray actor per simulated GPU and a time scale that keeps them below
the machine's cores; at 64 workers on two cores Redis lookups time out before a run can pass
the saturation check. The planner's `VirtualCluster` runs pdserve's own engine, scheduler,
router policy and timing model on a virtual clock in one process, with no Ray, no Redis (the
router knows prefixes only from what it routed) and no sleeping, so any size runs in seconds.

Each policy gets a fresh cluster: the warm-up prompts (as the live bench sends them, at the same
rate) arrive first, the workload one second of simulated time after the last of them, and only
the workload is reported. Prompt tokens computed for the workload are every worker's
`prefill_tokens` less the warm-up's, which no cache can shorten (random, unshared prompts).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.planner_validation import routing_tenants
from pdserve.bench.simulation import sim_routing_bench
from pdserve.bench.simulation.sim_routing_bench import (
    PolicyResult,
    policy_result,
    warm_up_requests,
    workload,
)
from pdserve.workloads.datasets import BenchRequest
from pdserve.workloads.metrics import RequestRecord

# Simulated seconds between the warm-up's last arrival and the workload's first.
WARM_UP_GAP_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    sim_routing_bench.add_arguments(p)
    routing_tenants.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "workload", "multi-turn") == "tenants":
        return routing_tenants.run(args)
    return sim_routing_bench.run(args, measure_size_with=measure_size_offline)


@dataclass
class OfflineRun:
    """One policy's workload on a fresh virtual cluster, in simulated time."""

    records: list[RequestRecord]
    computed_tokens: int  # prompt tokens the workers computed for the workload
    local_prefills: float  # fraction of completed requests prefilled on their decode worker


def run_offline(
    model_dir: Path,
    size: int,
    prefill: int,
    decode: int,
    policy: str,
    warm: Sequence[BenchRequest],
    requests: Sequence[BenchRequest],
    args: argparse.Namespace,
) -> OfflineRun:
    from pdserve.bench.common.load_generator import arrival_times
    from pdserve.config import RouterConfig
    from pdserve.planner.deployment import Deployment
    from pdserve.planner.probe import SLO, Split, run_probe
    from pdserve.planner.workload import ProbeRequest

    deployment = Deployment(
        str(model_dir),
        profile=args.sim_profile,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
    )
    rate = args.rate_per_worker * size
    warm_at = arrival_times(len(warm), rate, seed=args.seed)
    start = warm_at[-1] + WARM_UP_GAP_S
    load_at = [start + t for t in arrival_times(len(requests), rate, seed=args.seed)]
    # A probe's arrivals are in units of the mean gap: at `rate`, t seconds is t * rate.
    probes = [
        ProbeRequest(k, list(r.prompt), r.output_len, t * rate)
        for k, (r, t) in enumerate(zip([*warm, *requests], warm_at + load_at, strict=True))
    ]
    router = RouterConfig(
        policy=policy,
        disaggregate="auto",
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
    )
    slo = SLO(args.ttft_slo_ms, args.tpot_slo_ms)
    _, runs = run_probe(
        deployment, Split(prefill, decode), probes, rate, slo, router, stop_when_certain=False
    )
    measured = runs[len(warm) :]
    workers = runs[0].cluster.workers.values()
    computed = sum(w.stats().prefill_tokens for w in workers) - sum(r.prompt_len for r in warm)
    done = [r for r in measured if r.record.ok]
    local = sum(1 for r in done if r.route.prefill_worker is None)
    return OfflineRun([r.record for r in measured], computed, local / max(1, len(done)))


def measure_size_offline(
    model_dir: Path,
    model_config: dict,
    size: int,
    prefill: int,
    decode: int,
    policies: list[str],
    args: argparse.Namespace,
) -> list[PolicyResult]:
    """Each policy on a fresh virtual cluster."""
    warm = warm_up_requests(args, size, model_config)
    results = []
    for i, policy in enumerate(policies):
        requests = workload(args, size, model_config, args.seed + 1 + i)
        run = run_offline(model_dir, size, prefill, decode, policy, warm, requests, args)
        results.append(
            policy_result(
                size, policy, run.records, requests, run.computed_tokens, run.local_prefills, args
            )  # fmt: skip
        )
    return results
