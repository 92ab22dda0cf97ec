"""`pdserve bench sim-role-switching`: `--role-switching` on the phase-shifting trace, against
every static layout of the same GPUs, on the planner's virtual cluster of pdserve/sim engines.

The trace is the suite's `phases` (chat, code, RAG, agentic one after another; at rate r each
lasts N / 4r simulated seconds). Each layout's goodput (DistServe's: the highest rate at which
>= 90% of the requests meet both SLOs) is found by the same bisection over the rate: colocated
(`--disaggregate never`), every static P:D split (`always`), and the switching cluster, which
starts at `--start-split` and moves workers with the router's own decision code
(router/role_hysteresis.py) through pdserve/planner/role_switching.py's drain.

Its plans: the online planner makes its search (`planner.search.Search` over every split of
the live workers) from the last window's requests every interval; so as to cost minutes here,
that search is made once per phase kind before the runs, on that kind's requests, and each
interval the switcher is handed the plan of the kind most of the window's requests were.
The switch's cost is reported from the run at the switching goodput: switches, drain time
(simulated), blocks of prefix cache kept (a restart would lose them all) and requests of the
old role still running when a drain timed out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.simulation.disagg_suite.suite import (
    INDEX_LAG_S,
    MODELS,
    SLOS,
    Setting,
    deployment_of,
)
from pdserve.bench.simulation.disagg_suite.workloads import suite_sample
from pdserve.config import RouterConfig
from pdserve.planner.deployment import Deployment
from pdserve.planner.probe import SLO, Split, run_probe
from pdserve.planner.role_switching import VirtualRoleSwitcher, VirtualSwitch
from pdserve.planner.search import Search
from pdserve.planner.splits import all_splits
from pdserve.planner.workload import ProbeRequest
from router.role_hysteresis import RoleHysteresis, split_name

KINDS = ("chat", "code", "rag", "agentic")  # the phases, in the trace's order
STEP = 1.25  # the bisection's walk: x1.25 up while passing, /1.25 down while failing
QUICK = {"requests": 800, "plan_requests_per_worker": 30, "precision": 0.2}
ONE_TP_MODELS = sorted(name for name, setup in MODELS.items() if setup.prefill_tp is None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="70b", choices=ONE_TP_MODELS,
                   help="suite model setup (one TP: a worker keeps its GPUs as it switches)")  # fmt: skip
    p.add_argument("--slo", default="tight-tpot", choices=sorted(SLOS), help="suite SLO pair")
    p.add_argument("--requests", type=int, default=2000, help="requests in the trace")
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--batch", type=int, default=128, help="max_num_seqs")
    p.add_argument("--start-rate", type=float, default=4.0, help="the bisection's first rate")
    p.add_argument("--precision", type=float, default=0.1, help="goodput bracket")
    p.add_argument("--plan-requests-per-worker", type=int, default=50, help="plans' probe size")
    p.add_argument("--start-split", default="", help="P:D the switching run starts at")
    p.add_argument("--interval-s", type=float, default=10.0, help="plan interval (simulated)")
    p.add_argument("--dwell-s", type=float, default=20.0, help="--role-switch-dwell-s")
    p.add_argument("--margin", type=float, default=0.1, help="--role-switch-margin")
    p.add_argument("--drain-s", type=float, default=10.0, help="--role-switch-drain-s")
    p.add_argument(
        "--phase-rates",
        default="",
        help="KIND=X,...: that phase's requests arrive X times as fast as the rate probed "
        "(e.g. rag=0.25: a RAG phase at a quarter of the others' rate)",
    )
    p.add_argument("--quick", action="store_true", help="a smaller trace and coarser goodputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="write the results as JSON here")


@dataclass
class LayoutGoodput:
    layout: str
    goodput: float
    probes: int
    switches: list[VirtualSwitch] = field(default_factory=list)  # at the goodput's rate


def run(args: argparse.Namespace) -> int:
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    setup = MODELS[args.model]
    ttft, tpot = SLOS[args.slo]
    slo = SLO(ttft, tpot)
    deployment = deployment_of(setup.model, setup.tp, Setting(args.chunk, args.batch))
    trace = shaped(suite_sample("phases", args.requests, args.seed), args.phase_rates)
    workers = setup.workers
    started = time.perf_counter()
    print(
        f"{setup.model} on {setup.gpus} H100s (TP {setup.tp}, {workers} workers), SLO "
        f"{args.slo} (TTFT {ttft:g} ms, TPOT {tpot:g} ms), phases trace of {len(trace)} "
        f"requests{' (' + args.phase_rates + ')' if args.phase_rates else ''}, chunk "
        f"{args.chunk} batch {args.batch}",
        flush=True,
    )
    plans = phase_plans(deployment, setup.tp, workers, slo, args)
    for kind, plan in plans.items():
        print(f"  plan for {kind}: {plan['recommended']} ({plan['goodput_rps']:.2f} req/s)")
    results = [
        static_goodput(deployment, split, trace, slo, args)
        for split in (Split(p, workers - p, setup.tp, setup.tp) for p in range(workers))
    ]
    start = _start_split(args.start_split, workers)
    results.append(switching_goodput(deployment, setup.tp, start, trace, slo, plans, args))
    print_report(results, args, time.perf_counter() - started)
    if args.out:
        Path(args.out).write_text(json.dumps(_json(results, plans, args), indent=2) + "\n")
    return 0


def shaped(trace: list[ProbeRequest], phase_rates: str) -> list[ProbeRequest]:
    """The trace with each phase's gaps between arrivals divided by its rate multiplier."""
    rates = {}
    for item in filter(None, (x.strip() for x in phase_rates.split(","))):
        kind, _, value = item.partition("=")
        if kind not in KINDS or not value or float(value) <= 0:
            raise ValueError(
                f"--phase-rates {item!r}: KIND=X, KIND one of {', '.join(KINDS)}, X > 0"
            )
        rates[kind] = float(value)
    if not rates:
        return trace
    arrival, previous, out = 0.0, 0.0, []
    for r in trace:
        arrival += (r.unit_arrival - previous) / rates.get(_kind(r.tag), 1.0)
        previous = r.unit_arrival
        out.append(dataclasses.replace(r, unit_arrival=arrival))
    return out


def phase_plans(
    deployment: Deployment, tp: int, workers: int, slo: SLO, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Each phase kind's plan, in the online planner's answer's form (pdserve/planner/online.py):
    the search over every split of the workers, on that kind's requests alone."""
    plans = {}
    for i, kind in enumerate(KINDS):
        sample = suite_sample(kind, args.plan_requests_per_worker * workers, args.seed + 10 + i)
        search = Search(
            deployment, sample, slo, _router(slo, "always", len(sample)),
            precision=args.precision, top=1,
            requests_per_worker=args.plan_requests_per_worker, index_lag_s=INDEX_LAG_S,
        )  # fmt: skip
        splits = [Split(s.prefill, s.decode, tp, tp) for s in all_splits(workers)]
        plan = search.run(splits)
        chosen = plan.recommended.split
        plans[kind] = {
            "workers": workers,
            "recommended": split_name(chosen.prefill, chosen.decode),
            "prefill_workers": chosen.prefill,
            "decode_workers": chosen.decode,
            "goodput_rps": plan.recommended.goodput,
            "splits": [
                {
                    "split": split_name(r.split.prefill, r.split.decode),
                    "goodput_rps": r.goodput,
                    "pruned": r.pruned,
                }
                for r in plan.results
            ],
        }
    return plans


def static_goodput(
    deployment: Deployment, split: Split, trace: list[ProbeRequest], slo: SLO, args
) -> LayoutGoodput:
    rule = "always" if split.prefill else "never"
    router = _router(slo, rule, len(trace))

    def passes(rate: float) -> bool:
        result, _ = run_probe(deployment, split, trace, rate, slo, router, index_lag_s=INDEX_LAG_S)
        return result.passed

    goodput, probes = bisect_goodput(passes, args.start_rate, args.precision)
    name = split_name(split.prefill, split.decode)
    print(f"  {name}: {goodput:.2f} req/s ({probes} probes)", flush=True)
    return LayoutGoodput(name, goodput, probes)


def switching_goodput(
    deployment: Deployment,
    tp: int,
    start: tuple[int, int],
    trace: list[ProbeRequest],
    slo: SLO,
    plans: dict[str, dict[str, Any]],
    args: argparse.Namespace,
) -> LayoutGoodput:
    router = _router(slo, "always", len(trace))
    split = Split(start[0], start[1], tp, tp)
    switches_at: dict[float, list[VirtualSwitch]] = {}

    def plan_of(window: list[ProbeRequest]) -> dict[str, Any]:
        kind = Counter(_kind(r.tag) for r in window).most_common(1)[0][0]
        return plans[kind]

    def passes(rate: float) -> bool:
        made: list[VirtualRoleSwitcher] = []

        def attach(cluster) -> Callable[[ProbeRequest], None]:
            hysteresis = RoleHysteresis(args.dwell_s, args.margin)
            switcher = VirtualRoleSwitcher(
                cluster, hysteresis, plan_of, args.interval_s, args.drain_s
            ).start()
            made.append(switcher)
            return switcher.arrived

        result, _ = run_probe(
            deployment, split, trace, rate, slo, router, index_lag_s=INDEX_LAG_S, attach=attach
        )
        switches_at[rate] = made[0].switches
        return result.passed

    goodput, probes = bisect_goodput(passes, args.start_rate, args.precision)
    name = f"switching from {split_name(*start)}"
    switches = switches_at.get(goodput, [])
    print(f"  {name}: {goodput:.2f} req/s ({probes} probes, {len(switches)} switches)")
    return LayoutGoodput(name, goodput, probes, switches)


def bisect_goodput(
    passes: Callable[[float], bool], start: float, precision: float
) -> tuple[float, int]:
    """The highest rate that passed, within `precision` of the lowest that failed (0.0 when
    none passed down to 1/100 of `start`); and how many probes it took."""
    passed, failed, rate, probes = 0.0, math.inf, start, 0
    while (passed == 0.0 or failed == math.inf) and start / 100 < rate < start * 100:
        probes += 1
        if passes(rate):
            passed, rate = rate, rate * STEP
        else:
            failed, rate = rate, rate / STEP
        if passed and failed < math.inf:
            break
    while passed and failed < math.inf and failed / passed > 1 + precision:
        rate = math.sqrt(passed * failed)
        probes += 1
        if passes(rate):
            passed = rate
        else:
            failed = rate
    return passed, probes


def print_report(results: list[LayoutGoodput], args: argparse.Namespace, seconds: float) -> None:
    switching = results[-1]
    static = results[:-1]
    colocated = static[0]
    best_split = max(static[1:], key=lambda r: r.goodput)
    best_static = max(static, key=lambda r: r.goodput)
    print()
    print("| layout | goodput (req/s) |")
    print("|---|---|")
    for r in results:
        print(f"| {r.layout} | {r.goodput:.2f} |")
    print()
    for label, other in (("best static split", best_split), ("best static layout", best_static),
                         ("colocated", colocated)):  # fmt: skip
        ratio = switching.goodput / other.goodput if other.goodput else math.inf
        print(f"switching / {label} ({other.layout}): {ratio:.2f}x")
    if switching.switches:
        drains = [s.drain_s for s in switching.switches]
        kept = [s.blocks_kept for s in switching.switches]
        print(
            f"switch cost at {switching.goodput:.2f} req/s: {len(drains)} switches, drain "
            f"{sum(drains) / len(drains):.2f} s mean / {max(drains):.2f} s max (simulated), "
            f"{min(kept)}-{max(kept)} cached blocks kept (0 lost), "
            f"{sum(s.still_running for s in switching.switches)} requests past a drain timeout"
        )
    print(f"({seconds:.0f} s wall)")


def _router(slo: SLO, rule: str, pending: int) -> RouterConfig:
    return RouterConfig(
        disaggregate=rule, ttft_slo_ms=slo.ttft_ms, tpot_slo_ms=slo.tpot_ms,
        max_pending_requests=max(RouterConfig().max_pending_requests, pending),
    )  # fmt: skip


def _kind(tag: str | None) -> str:
    return (tag or "chat").split(":")[0]


def _start_split(value: str, workers: int) -> tuple[int, int]:
    if not value:
        return workers // 2, workers - workers // 2
    prefill, decode = (int(x) for x in value.split(":"))
    if prefill + decode != workers or decode < 1 or prefill < 0:
        raise ValueError(f"--start-split {value}: P:D of {workers} workers, D at least 1")
    return prefill, decode


def _json(results: list[LayoutGoodput], plans: dict, args: argparse.Namespace) -> dict:
    return {
        "args": {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool)},
        "plans": plans,
        "layouts": [asdict(r) for r in results],
    }
