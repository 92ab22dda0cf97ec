"""The simulated side of `pdserve bench layout-ranking` (layout_ranking.py): the two layouts
on the planner's virtual cluster with the profile and KV pushes fitted on the real workers,
the requests offered at a rate, and a layout's simulated goodput over rising rates."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pdserve.bench.simulation.fidelity_bench import UNMEASURABLE_LINK_GBPS

# name: (prefill workers, decode workers, the router's --disaggregate)
LAYOUTS = {"1P:1D": (1, 1, "always"), "colocated 2": (0, 2, "never")}
# The simulated sweep that places each layout's goodput: rates from SWEEP_START req/s up by
# SWEEP_STEP until both layouts miss, at most SWEEP_MAX_RATES of them.
SWEEP_START, SWEEP_STEP, SWEEP_MAX_RATES = 0.05, 1.15, 60


def link_gbps(pushes: dict) -> float:
    """The link rate of the fitted pushes (push_costs), a stand-in where none was measurable."""
    return pushes["link_gbps"] or UNMEASURABLE_LINK_GBPS


def sim_deployment(model_dir: Path, profile: str, pushes: dict, args: argparse.Namespace):
    """The simulated workers: the real ones' engine settings and KV pool, the fitted profile,
    the link and fixed cost of the measured `pushes` (push_costs)."""
    from pdserve.core.model_limits import kv_pool_blocks
    from pdserve.engine_config import EngineConfig
    from pdserve.planner.deployment import Deployment
    from pdserve.sim.executor import read_model_config

    real = EngineConfig(model=str(model_dir), max_num_batched_tokens=args.max_num_batched_tokens)
    return Deployment(
        str(model_dir),
        profile=profile,
        dtype=real.dtype,
        link_gbps=link_gbps(pushes),
        push_fixed_s=pushes["fixed_ms"] / 1e3,
        max_num_seqs=real.max_num_seqs,
        max_num_batched_tokens=real.max_num_batched_tokens,
        block_size=real.block_size,
        num_kv_blocks=kv_pool_blocks(read_model_config(model_dir), real),
    )


def sim_records(deployment: Any, layout: str, requests: list, rate: float, args) -> list:
    """The records of `requests` offered to the simulated `layout` at `rate`, arriving as the
    load generator releases them (its arrival schedule for this rate and seed)."""
    from pdserve.bench.common.load_generator import arrival_times
    from pdserve.config import RouterConfig
    from pdserve.planner.probe import SLO, Split, run_probe
    from pdserve.planner.workload import ProbeRequest

    prefill, decode, disaggregate = LAYOUTS[layout]
    at = arrival_times(len(requests), rate, seed=args.seed)
    # A probe's arrivals are in units of the mean gap: at `rate`, t seconds is t * rate.
    probes = [
        ProbeRequest(k, list(r.prompt), r.output_len, t * rate)
        for k, (r, t) in enumerate(zip(requests, at, strict=True))
    ]
    router = RouterConfig(
        disaggregate=disaggregate, ttft_slo_ms=args.slo_ttft_ms, tpot_slo_ms=args.slo_tpot_ms
    )
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.attainment)
    split = Split(prefill, decode)
    _, runs = run_probe(deployment, split, probes, rate, slo, router, stop_when_certain=False)
    return [r.record for r in runs]


def sim_sweep(deployment: Any, layout: str, offered: Any, args) -> float:
    """The simulated goodput of `layout` over rising rates, `offered(rate)` the requests at
    each (stops two rates past the first miss)."""
    from pdserve.workloads.metrics import goodput_rate

    attained, rate, misses = {}, SWEEP_START, 0
    for _ in range(SWEEP_MAX_RATES):
        point = rate_point(sim_records(deployment, layout, offered(rate), rate, args), rate, args)
        attained[rate] = point["attainment"]
        misses += point["attainment"] < args.attainment
        if misses >= 2:
            break
        rate = round(rate * SWEEP_STEP, 4)
    return goodput_rate(attained, args.attainment)


def rate_point(records: list, rate: float, args) -> dict:
    """One rate's figures from its records, real or simulated: attainment within the SLOs and
    the p90s."""
    from pdserve.workloads.metrics import run_duration, summarize

    summary = summarize(records, run_duration(records), args.slo_ttft_ms, args.slo_tpot_ms)
    return {
        "rate": rate,
        "attainment": summary.good_requests / summary.num_requests,  # failed ones: misses
        "failed": summary.failed,
        "ttft_p90_ms": summary.ttft.p90,
        "tpot_p90_ms": summary.tpot.p90,
    }
