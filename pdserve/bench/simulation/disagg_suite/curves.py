"""Goodput against offered rate, per layout family of a suite cell (`--suite --plot DIR`).

The search brackets one number per family (its goodput) with probes that stop as soon as
their verdict is certain, so their attainment says little away from the knee. A curve instead
offers each family's best layout (its split at its engine setting) the cell's sample at fixed
fractions of the cell's highest goodput, every request run to its end: the requests/s that
met both SLOs at each offered rate. Each point is as long as the search's steady probes
(`steady_requests_per_worker`, with --suite's default steady probes): a shorter probe ends
before the queue behind a full batch builds, and past the knee it met the SLOs at rates the
search had rightly failed (8B chat colocated: 97% at 1.5x its goodput on 500 requests a
worker). A curve that keeps up with the rate (the 0.9 x rate line
is the attainment bar) is a layout with headroom; where it bends over is its saturation.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.bench.simulation.disagg_suite.suite import (
    INDEX_LAG_S,
    MODELS,
    SLOS,
    Cell,
    SuiteOptions,
    cell_sample,
    family_router,
    family_splits,
    search_deployments,
)
from pdserve.planner.probe import SLO, run_probe
from pdserve.planner.search import steady_requests_per_worker
from pdserve.planner.splits import replica_count

# Offered rates, as fractions of the cell's highest goodput: below, at and past saturation.
CURVE_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
# As the search's probes: a split of k identical replicas is simulated as one at 1/k the rate,
# with at least this many workers.
MIN_REPLICA_WORKERS = 2


@dataclass
class Curve:
    family: str
    label: str  # the layout and its engine setting
    goodput: float  # the search's
    points: list[tuple[float, float]]  # (offered req/s, fraction that met both SLOs)


def cell_curves(cell: Cell, options: SuiteOptions, known: tuple[float, ...] = ()) -> list[Curve]:
    """Every searched family's curve, at the same offered rates (and each at its goodput):
    fractions of the highest goodput of the cell's families and of `known` (those of the same
    cell measured by earlier runs, so that curves drawn together share their rates)."""
    setup = MODELS[cell.model]
    sample = cell_sample(cell.model, cell.workload, options)
    slo = SLO(*SLOS[cell.slo])
    top = max((*(best.goodput for best in cell.families.values()), *known), default=0.0)
    curves = []
    for family, best in cell.families.items():
        if best.setting is None:  # never passed: no layout to offer load to
            continue
        split = next(s for s in family_splits(setup, family) if s.name == best.split)
        k = replica_count(split, MIN_REPLICA_WORKERS)
        replica = split.replica(k)
        deployment, pools = search_deployments(setup, best.setting, options.push_fixed_ms)
        deployment = pools(split) if pools else deployment  # the split's pools at their TPs
        per_worker = options.requests_per_worker
        if options.steady_probes:
            per_worker = max(per_worker, steady_requests_per_worker(deployment))
        requests = sample[: per_worker * (replica.prefill + replica.decode)]
        router = family_router(family, cell.slo, len(sample))
        points = []
        for rate in sorted({*(f * top for f in CURVE_FRACTIONS), best.goodput}):
            probe, _ = run_probe(
                deployment, replica, requests, rate / k, slo, router,
                stop_when_certain=False, index_lag_s=INDEX_LAG_S,
            )  # fmt: skip
            points.append((round(rate, 3), round(probe.good / probe.requests, 4)))
        setting = best.setting
        label = f"{best.split}, chunk {setting.chunk}, batch {setting.batch}"
        curves.append(Curve(family, label, best.goodput, points))
    return curves
