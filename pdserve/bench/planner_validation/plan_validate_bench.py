"""`pdserve bench plan-validate`: the planner's offline prediction against a live cluster of sim
workers serving the same requests (issue 20 point 2).

    pdserve bench plan-validate --json out/plan-validate.json

Each scenario is a workload preset of the planner (`chat`, `rag`, `mixed`: pdserve/planner/
workload.py over the `chat-rag` generator of datasets.py) on a small split (`chat=0:2`:
colocated on 2 workers, `rag=1:1`, `mixed=1:2`; `mixed=hybrid:2`: 2 hybrid workers, `--hybrid`).
For each:

1. Offline, on the virtual clock (pdserve/planner): the planner's `Search` gives the split's
   goodput G, every probe the same `--requests` requests; then `run_probe` serves that sample
   to the end at each rate of the sweep (`--rate-fractions` x G, bracketing G), for its p90
   TTFT and TPOT and its SLO attainment.
2. Live: the same split as real Ray actors with `--engine sim`, the real router, Redis index and
   transfer protocol (`sim_run.serve_sim`), started once; every rate of the sweep offered in
   turn, each under the saturation check (`sim_saturation.checked_run`). Goodput is the
   crossing of the attainment target on the swept curve (`metrics.goodput_rate`).

Both sides get the same requests, and every rate the same ones: the planner's `probe_sample`
(lengths and tags) of `--requests` with the load generator's arrival schedule
(`load_generator.arrival_times`, one seed, scaled by the rate), so request k arrives at the
same simulated instant on both sides, and the Search's goodput, the offline sweep and the live
sweep judge one sample. The sweep's rates (`--rate-fractions` of the goodput) are extended
until the offline sweep brackets the goodput (rates.py), so the live goodput is interpolated.
Live prompts are the same lengths with token ids drawn afresh per rate and attempt, so no rate
reuses another's cached prefixes (the offline cluster is fresh per probe). The offline router
runs at the live cluster's pace: a router at time scale S polls and backs off in wall time,
i.e. S times as often in simulated time, and its cost model's priors, in wall seconds, are
1 / S of the planner's in simulated time (`RouterTiming.scaled(1 / S)`). The live router
starts every rate from those priors too, and from the workers' counters as they are then
(`sim_run.set_routing(forget_costs=True)`), as every offline probe's router does, instead of what the warm-up and the rates before taught it. Live pushes are one
KV chunk each (`_cluster`): a sim chunk carries no bytes, so more chunks only add this
machine's thread and gRPC hops to the modelled link time. Per rate, the TTFT of requests
routed alike on both sides is split into parts (ttft_parts.py) and compared by request index.

The time scale (`--sim-time-scale`, 0 = auto) is chosen so the highest rate streams about
`--wall-tokens` tokens per wall second, at least `--min-time-scale`: what the two cores can
serve without the router or the workers falling behind the model. A scenario refused by the
saturation check is left out (exit status 3), the others are reported. All figures are
simulated.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import NamedTuple

from pdserve.bench.planner_validation.rates import bracketed_sweep
from pdserve.bench.planner_validation.report import (
    RatePoint,
    ScenarioResult,
    Side,
    point_line,
    ratios,
    report_table,
)
from pdserve.bench.planner_validation.ttft_parts import live_parts, offline_parts, parts_line
from pdserve.bench.simulation.sim_run import add_cluster_arguments

DEFAULT_SCENARIOS = "chat=0:2,rag=1:1,mixed=1:2"


class Scenario(NamedTuple):
    preset: str
    prefill: int
    decode: int
    hybrid: bool = False  # the decode workers also prefill for one another (`--hybrid`)

    @property
    def split(self) -> str:
        return f"hybrid {self.decode}" if self.hybrid else f"{self.prefill}P:{self.decode}D"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_arguments(p, time_scale=0.0)
    p.add_argument(
        "--scenarios",
        default=DEFAULT_SCENARIOS,
        help="comma separated PRESET=P:D (P = 0: colocated on D workers; PRESET=hybrid:D: D "
        "hybrid workers); presets chat, rag, mixed",
    )
    p.add_argument("--requests", type=int, default=160, help="requests per rate (and per probe)")
    p.add_argument(
        "--rate-fractions",
        default="0.7,0.95,1.1",
        help="live and offline rates, as fractions of the planner's goodput",
    )
    p.add_argument(
        "--extra-rates",
        type=int,
        default=3,
        help="at most this many rates added (x or / 1.15) until the offline sweep brackets "
        "the goodput",
    )
    p.add_argument(
        "--wall-tokens",
        type=float,
        default=1500.0,
        help="auto time scale: the highest rate streams about this many tokens per wall second",
    )
    p.add_argument("--min-time-scale", type=float, default=5.0, help="auto time scale at least")
    p.add_argument("--slo-ttft-ms", type=float, default=400.0)
    p.add_argument("--slo-tpot-ms", type=float, default=40.0)
    p.add_argument("--attainment", type=float, default=0.9, help="goodput's SLO attainment")
    p.add_argument("--precision", type=float, default=0.05, help="the planner's bisection")
    p.add_argument("--tolerance", type=float, default=0.15, help="agreement wanted, as a ratio")
    p.add_argument(
        "--jitter",
        type=float,
        default=0.01,
        help="offline: p90 range over the rate x (1 -/+ this), the p90s' own sensitivity",
    )
    p.add_argument("--policy", default="cost")
    p.add_argument(
        "--warmup-requests", type=int, default=8, help="live, before the sweep, at its lowest rate"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every figure to this file")


def parse_scenarios(spec: str) -> list[Scenario]:
    """The Scenario of each `PRESET=P:D` (or `PRESET=hybrid:D`); ValueError naming a bad one."""
    from pdserve.planner.workload import PRESETS

    scenarios = []
    for item in spec.split(","):
        preset, _, split = item.strip().partition("=")
        hybrid = split.startswith("hybrid:")
        try:
            prefill, decode = (int(n) for n in split.replace("hybrid:", "0:", 1).split(":"))
        except ValueError:
            raise ValueError(f"--scenarios {item.strip()!r}: expected PRESET=P:D") from None
        if preset not in PRESETS:
            raise ValueError(
                f"--scenarios {item.strip()!r}: unknown preset (known: chat, rag, mixed)"
            )
        if prefill < 0 or decode < 1:
            raise ValueError(f"--scenarios {item.strip()!r}: needs P >= 0 and D >= 1")
        scenarios.append(Scenario(preset, prefill, decode, hybrid))
    return scenarios


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.simulation.sim_run import bench_error, config_only_model, ensure_ray
    from pdserve.bench.simulation.sim_saturation import Saturated

    try:
        scenarios = parse_scenarios(args.scenarios)
        fractions = sorted(float(f) for f in args.rate_fractions.split(","))
        if not fractions or fractions[0] <= 0:
            raise ValueError("--rate-fractions: positive numbers")
    except ValueError as e:
        return bench_error(str(e), 2)
    model_dir = Path(args.model) if args.model else config_only_model()
    import ray

    started_ray = not ray.is_initialized()
    ensure_ray(max(s.prefill for s in scenarios), max(s.decode for s in scenarios))
    results, refused = [], []
    began = time.perf_counter()
    try:
        for scenario in scenarios:
            print(f"{scenario.preset} on {scenario.split}", flush=True)
            try:
                results.append(validate(model_dir, scenario, fractions, args))
            except (Saturated, ValueError) as e:  # the others still count, not this one
                print(f"  refused: {e}", flush=True)
                refused.append(str(e))
    finally:
        if started_ray:
            ray.shutdown()
    print(report_table(results, args))
    print(f"wall time: {time.perf_counter() - began:.0f} s in all")
    if args.json:
        document = [asdict(r) | {"ratios": ratios(r)} for r in results]
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    for line in refused:
        bench_error(line, 3)
    return 3 if refused else 0


def validate(model_dir: Path, scenario: Scenario, fractions, args) -> ScenarioResult:
    """Offline prediction, then the live sweep at the same rates, of one scenario."""
    from pdserve.planner.workload import load_workload
    from pdserve.workloads.metrics import goodput_rate

    preset, prefill, decode = scenario.preset, scenario.prefill, scenario.decode
    workload = load_workload(preset, max(args.requests * 4, 1000), args.seed)
    sample = _sample(workload, args.requests, args.seed)
    began = time.perf_counter()
    planner = OfflineCluster(model_dir, scenario, args)
    # The planner's own prediction (a router polling every 0.25 s) sets the time scale; the
    # prediction compared is then made at the live router's pace in simulated time.
    unscaled = planner.search(sample).goodput
    mean_output = sum(r.output_len for r in sample) / len(sample)
    scale = args.sim_time_scale or _auto_scale(unscaled * fractions[-1] * mean_output, args)
    planner.set_time_scale(scale)
    plan = planner.search(sample)
    goodput = plan.goodput
    if goodput <= 0:
        raise ValueError(f"{preset} on {scenario.split}: no rate meets the SLOs offline")
    planned = Side(goodput, plan.saturated)
    planned.points = bracketed_sweep(
        lambda rate: planner.probe(sample, rate, args.jitter),
        goodput, fractions, args.attainment, max_extra=args.extra_rates,
    )  # fmt: skip
    rates = [p.rate for p in planned.points]
    result = ScenarioResult(
        preset, preset, prefill, decode, args.requests, scale, planned, Side(),
        offline_sweep_goodput=goodput_rate(_attainment(planned), args.attainment),
        unscaled_goodput=unscaled,
        search_probes=len(plan.probes), offline_seconds=time.perf_counter() - began,
        hybrid=scenario.hybrid,
    )  # fmt: skip
    print(
        f"  planned goodput {goodput:.2f} req/s ({len(plan.probes)} probes; {unscaled:.2f} at "
        f"a real router's pace); rates "
        f"{', '.join(f'{r:.2f}' for r in rates)}; time scale {scale:g}; offline "
        f"{result.offline_seconds:.0f} s",
        flush=True,
    )
    for point in planned.points:
        print(f"  planned {point_line(point)}", flush=True)
    began = time.perf_counter()
    result.live.points, result.saturation = live_sweep(
        model_dir, scenario, sample, planned.points, scale, args
    )
    attainment = _attainment(result.live)
    result.live.goodput = goodput_rate(attainment, args.attainment)
    result.live.goodput_is_lower_bound = min(attainment.values()) >= args.attainment
    result.live_seconds = time.perf_counter() - began
    return result


def _auto_scale(tokens_per_s: float, args) -> float:
    """The time scale at which `tokens_per_s` simulated arrive at `--wall-tokens` per wall
    second: what the router process streams (it shares one GIL with the load generator)."""
    from pdserve.bench.simulation.sim_saturation import _round_up

    return max(args.min_time_scale, _round_up(tokens_per_s / args.wall_tokens))


def _attainment(side: Side) -> dict[float, float]:
    return {p.rate: p.attainment for p in side.points}


def _sample(workload, size: int, seed: int):
    """The planner's probe sample, arriving on the load generator's schedule (unit rate)."""
    from pdserve.bench.common.load_generator import arrival_times
    from pdserve.planner.workload import probe_sample

    sample = probe_sample(workload, size, seed)
    unit = arrival_times(len(sample), 1.0, seed=seed)
    return [replace(r, unit_arrival=t) for r, t in zip(sample, unit, strict=True)]


class OfflineCluster:
    """The planner's deployment, router settings and searches for one split."""

    def __init__(self, model_dir: Path, scenario: Scenario, args) -> None:
        from pdserve.bench.simulation.sim_run import gpu_kv_blocks
        from pdserve.config import RouterConfig
        from pdserve.planner.deployment import Deployment
        from pdserve.planner.probe import SLO, Split
        from pdserve.sim.profiles import AnalyticalProfile, parse_profile

        cluster = _cluster(scenario, args, scale=1.0)
        profile = parse_profile(args.sim_profile)
        blocks = args.num_kv_blocks or gpu_kv_blocks(
            json.loads((model_dir / "config.json").read_text()), cluster
        )
        self.deployment = Deployment(
            str(model_dir),
            gpu=profile.gpu if isinstance(profile, AnalyticalProfile) else "h100",
            profile=args.sim_profile,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            num_kv_blocks=blocks,
        )
        self.split = Split(scenario.prefill, scenario.decode, hybrid=scenario.hybrid)
        self.slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.attainment)
        self.router = RouterConfig(
            policy=args.policy,
            disaggregate=cluster.disaggregate,
            ttft_slo_ms=args.slo_ttft_ms,
            tpot_slo_ms=args.slo_tpot_ms,
            max_pending_requests=max(RouterConfig().max_pending_requests, args.requests),
        )
        self.precision = args.precision
        self.set_time_scale(1.0)

    def set_time_scale(self, scale: float) -> None:
        from pdserve.planner.cluster import RouterTiming

        self.timing = RouterTiming().scaled(1.0 / scale)

    def search(self, sample):
        """The planner's goodput search over this one split, every probe the whole sample."""
        from pdserve.planner.search import Search

        workers = self.split.prefill + self.split.decode
        search = Search(
            self.deployment, sample, self.slo, self.router, self.timing,
            precision=self.precision, top=1, requests_per_worker=-(-len(sample) // workers),
            min_replica_workers=workers,
        )  # fmt: skip
        return search.run([self.split]).best

    def probe(self, sample, rate: float, jitter: float = 0.0) -> RatePoint:
        """The sample served to the end at `rate`; with a jitter, the attainment's and the
        p90s' ranges over the rate and the rate x (1 -/+ jitter) too."""
        point = self._probe(sample, rate)
        if jitter > 0:
            nudged = [point] + [self._probe(sample, rate * f) for f in (1 - jitter, 1 + jitter)]
            ttft, tpot = [p.ttft_p90_ms for p in nudged], [p.tpot_p90_ms for p in nudged]
            attainment = [p.attainment for p in nudged]
            point.ttft_p90_range_ms, point.tpot_p90_range_ms = (
                [min(ttft), max(ttft)],
                [min(tpot), max(tpot)],
            )
            point.attainment_range = [min(attainment), max(attainment)]
        return point

    def _probe(self, sample, rate: float) -> RatePoint:
        from pdserve.planner.probe import run_probe

        result, runs = run_probe(
            self.deployment, self.split, sample, rate, self.slo, self.router, self.timing,
            stop_when_certain=False,
        )  # fmt: skip
        done = [r for r in runs if r.record.ok]
        local = sum(r.route is not None and r.route.prefill_worker is None for r in done)
        return RatePoint(
            rate, result.good / result.requests, result.ttft.count, result.ttft.p90,
            result.tpot.p90, local / max(1, len(done)), requests=offline_parts(runs),
        )  # fmt: skip


def _cluster(scenario: Scenario, args, scale: float):
    from pdserve.bench.simulation.sim_run import cluster_from_args

    fields = dict(prefill_workers=scenario.prefill, decode_workers=scenario.decode)
    fields |= dict(policy=args.policy, hybrid=scenario.hybrid)
    fields |= dict(ttft_slo_ms=args.slo_ttft_ms, tpot_slo_ms=args.slo_tpot_ms)
    colocated = scenario.prefill == 0 and not scenario.hybrid
    fields["disaggregate"] = "never" if colocated else "auto"
    # One KV chunk per push (up to 1 GiB, 8192 tokens of the 8B shape): with the default 4 MiB
    # a rag prompt's push was 32 chunks, whose thread and gRPC hops on this loaded machine
    # added ~10 ms (of ~16) to every live push at time scale 10; the planner models the link.
    fields["kv_chunk_bytes"] = 1 << 30
    return replace(cluster_from_args(args, **fields), time_scale=scale)


def live_sweep(model_dir, scenario: Scenario, sample, planned, scale, args):
    """Every rate of the `planned` points on one started cluster of sim workers; (points,
    saturation summaries). The sample's arrivals at each rate are the load generator's
    schedule of `--seed`, as offline."""
    from pdserve.bench.simulation.sim_run import (
        local_prefill_fraction,
        run_sim_load,
        serve_sim,
        set_routing,
        wait_idle,
    )
    from pdserve.bench.simulation.sim_saturation import checked_run
    from pdserve.workloads.metrics import run_duration, slo_attainment, summarize

    config = json.loads((model_dir / "config.json").read_text())
    checked_args = argparse.Namespace(**vars(args) | {"sim_time_scale": scale})
    points, saturation = [], []
    rates = [p.rate for p in planned]
    with serve_sim(model_dir, _cluster(scenario, args, scale), config) as app:
        if args.warmup_requests:
            warm = _live_requests(sample[: args.warmup_requests], config, (args.seed, 99))
            run_sim_load(app, warm, rates[0], scale, seed=args.seed)
            wait_idle(app)
        for i, rate in enumerate(rates):

            def attempt(n: int, rate=rate, i=i):
                requests = _live_requests(sample, config, (args.seed, i, n))
                # As every offline probe's router starts: not from what earlier rates taught it.
                set_routing(app, forget_costs=True)
                return run_sim_load(app, requests, rate, scale, seed=args.seed)

            label = f"{scenario.preset} {scenario.split} at {rate:.2f} req/s"
            records, check = checked_run(app, checked_args, attempt, label)
            summary = summarize(records, run_duration(records))
            point = RatePoint(
                rate, slo_attainment(records, args.slo_ttft_ms, args.slo_tpot_ms),
                summary.completed, summary.ttft.p90, summary.tpot.p90,
                local_prefill_fraction(records), requests=live_parts(records, scale),
            )  # fmt: skip
            points.append(point)
            saturation.append(check.summary())
            parts = parts_line(planned[i].requests, point.requests)
            print(
                f"  live {point_line(point)}, {summary.failed} failed, router busy "
                f"{check.router_busy:.0%}\n    TTFT parts: {parts}",
                flush=True,
            )
    return points, saturation


def _live_requests(sample, model_config: dict, seed):
    """The sample's requests with fresh prompt token ids of the same lengths."""
    import numpy as np

    from pdserve.bench.common.local_system import eos_ids
    from pdserve.workloads.datasets import BenchRequest

    rng = np.random.default_rng(list(seed))
    special = set(eos_ids(model_config)) | {model_config.get("bos_token_id")}
    allowed = np.setdiff1d(
        np.arange(model_config["vocab_size"]), [t for t in special if t is not None]
    )
    return [
        BenchRequest(allowed[rng.integers(0, len(allowed), len(r.prompt))].tolist(),
                     len(r.prompt), r.output_len, r.tag)
        for r in sample
    ]  # fmt: skip
