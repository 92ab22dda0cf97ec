"""`sim-disagg --suite --at-rates`: each family's SLO attainment at the same offered rates.

A goodput is the highest rate a bisection passed, and near a layout's edge the virtual
cluster's outcome turns on small things: on 70B mix at the loose SLOs, `auto` on 1P:3D kept
90.1% of 8192 requests within both SLOs at 37.685 req/s and 88.2% at 37.68. Two families whose
goodputs lie within a few percent are told apart here instead: both are offered the same
sample at the same rates, on the same layout and engine setting (common random numbers), and
the one within its SLOs more often at most rates serves more. Each probe is the steady one the
search confirms a goodput with, run to its end, on one replica of the layout at its share of
the rate (as the search probes it): families on the same layout get the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.bench.simulation.disagg_suite.suite import (
    INDEX_LAG_S,
    MODELS,
    SLOS,
    Setting,
    SuiteOptions,
    cell_sample,
    family_router,
    family_splits,
    search_deployments,
)
from pdserve.planner.probe import SLO, Split
from pdserve.planner.search import Search


@dataclass(frozen=True)
class PairedProbe:
    family: str
    layout: str
    rate: float  # requests/s offered to the whole cluster
    requests: int
    good: int  # within both SLOs
    ttft_mean_ms: float  # point 5's TTFT target compares means
    ttft_p90_ms: float
    tpot_p90_ms: float
    remote_share: float
    # False: stopped once its verdict was certain (`paired_attainment(to_end=False)`), so
    # `attainment` counts only the requests judged by then; a failing one's true attainment
    # lies below 1 - missed / requests.
    complete: bool = True
    missed: int = 0

    @property
    def attainment(self) -> float:
        return self.good / self.requests


def family_layout(model: str, family: str, split: str) -> Split:
    """The layout `family` is probed on: colocated its own; the others the split named "P:D",
    or every worker hybrid ("hybrid", `auto` only)."""
    layouts = family_splits(MODELS[model], family, () if family == "colocated" else (split,))
    if not layouts:
        raise ValueError(f"{family} has no layout {split!r}")
    return layouts[0]


def paired_attainment(
    model: str,
    workload: str,
    slo_name: str,
    families: list[str],
    split: str,
    setting: Setting,
    rates: list[float],
    options: SuiteOptions,
    to_end: bool = True,
) -> list[PairedProbe]:
    """Every family at every rate, in that order, each on the cell's sample (`to_end` False:
    each probe stops once its verdict is certain)."""
    setup = MODELS[model]
    deployment, pools = search_deployments(setup, setting, options.push_fixed_ms)
    sample = cell_sample(model, workload, options)
    slo = SLO(*SLOS[slo_name])
    layouts = {f: family_layout(model, f, split) for f in families}
    searches = {
        f: Search(deployment, sample, slo, family_router(f, slo_name, len(sample)),
                  requests_per_worker=options.requests_per_worker, deployment_for=pools,
                  index_lag_s=INDEX_LAG_S)
        for f in families
    }  # fmt: skip
    probes = []
    for rate in rates:
        for family in families:
            result = searches[family].steady_probe(layouts[family], rate, to_end)
            probes.append(
                PairedProbe(
                    family,
                    layouts[family].name,
                    rate,
                    result.requests,
                    result.good,
                    result.ttft.mean,
                    result.ttft.p90,
                    result.tpot.p90,
                    result.remote_share,
                    result.complete,
                    result.missed,
                )  # fmt: skip
            )
    return probes


def paired_table(probes: list[PairedProbe]) -> str:
    """Attainment per rate (rows) and family (columns), and how often each family led."""
    families = list(dict.fromkeys(p.family for p in probes))
    rates = list(dict.fromkeys(p.rate for p in probes))
    at = {(p.family, p.rate): p for p in probes}
    lines = ["SLO attainment at equal offered rates (same sample, layout and setting)",
             f"{'req/s':>8} " + " ".join(f"{f:>12}" for f in families)]  # fmt: skip
    led = dict.fromkeys(families, 0)
    for rate in rates:
        row = [at[f, rate].attainment for f in families]
        best = max(row)
        for f, value in zip(families, row, strict=True):
            led[f] += value == best
        lines.append(f"{rate:>8.2f} " + " ".join(f"{v:>12.4f}" for v in row))
    lines.append("highest attainment at: " + ", ".join(
        f"{f} {n} of {len(rates)} rates" for f, n in led.items()))  # fmt: skip
    return "\n".join(lines)
