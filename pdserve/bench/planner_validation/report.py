"""What `pdserve bench plan-validate` measures and prints: the planned and live figures of each
scenario, their ratios and the markdown table that goes into BENCHMARKS.md."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RatePoint:
    """One side at one rate: SLO attainment and p90 latencies, simulated milliseconds."""

    rate: float
    attainment: float
    completed: int
    ttft_p90_ms: float
    tpot_p90_ms: float
    local_prefills: float  # fraction of completed requests prefilled on their decode worker
    # Offline only: the p90s' range over the rate and the rate x (1 -/+ --jitter). A p90 of
    # ~100 requests near the knee moves that much with a 1% nudge: agreement closer than
    # this range is not measurable.
    ttft_p90_range_ms: list[float] = field(default_factory=list)
    tpot_p90_range_ms: list[float] = field(default_factory=list)
    # The same for the attainment: near the knee one local/remote choice that goes the other
    # way changes the routes of every later request (the cost model learns from what ran), so
    # a 1% nudge can move 60 requests' attainment by 10 points or more.
    attainment_range: list[float] = field(default_factory=list)
    # request index -> its TTFT parts and TPOT in ms (ttft_parts.py), disaggregated ones only
    requests: dict[int, dict[str, float]] = field(default_factory=dict)


@dataclass
class Side:
    goodput: float = 0.0
    goodput_is_lower_bound: bool = False
    points: list[RatePoint] = field(default_factory=list)


@dataclass
class ScenarioResult:
    name: str
    workload: str
    prefill_workers: int
    decode_workers: int
    requests: int
    time_scale: float
    planned: Side  # goodput: the planner's Search; points: full offline probes
    live: Side
    offline_sweep_goodput: float = 0.0  # goodput_rate over the offline points (same method)
    unscaled_goodput: float = 0.0  # the planner's Search at a real router's pace (time scale 1)
    search_probes: int = 0
    offline_seconds: float = 0.0
    live_seconds: float = 0.0
    saturation: list[dict] = field(default_factory=list)
    hybrid: bool = False  # the decode workers also prefill for one another (`--hybrid`)

    @property
    def split(self) -> str:
        p, d = self.prefill_workers, self.decode_workers
        if self.hybrid:
            return f"hybrid {d}"
        return f"colocated {d}" if p == 0 else f"{p}P:{d}D"


def point_line(point: RatePoint) -> str:
    return (
        f"{point.rate:.2f} req/s: attainment {point.attainment:.0%}, TTFT p90 "
        f"{point.ttft_p90_ms:.0f} ms, TPOT p90 {point.tpot_p90_ms:.1f} ms, local prefills "
        f"{point.local_prefills:.0%}"
    )


def ratios(result: ScenarioResult) -> dict:
    """live / planned: goodput, and p90 TTFT and TPOT at each rate."""

    def ratio(live: float, planned: float) -> float | None:
        return live / planned if planned > 0 else None

    return {
        "goodput": ratio(result.live.goodput, result.planned.goodput),
        "points": [
            {
                "rate": lp.rate,
                "ttft_p90": ratio(lp.ttft_p90_ms, pp.ttft_p90_ms),
                "tpot_p90": ratio(lp.tpot_p90_ms, pp.tpot_p90_ms),
            }
            for lp, pp in zip(result.live.points, result.planned.points, strict=True)
        ],
    }


def _range(bounds: list[float], spec: str) -> str:
    return f" ({bounds[0]:{spec}}–{bounds[1]:{spec}})" if bounds else ""


def within(value: float | None, tolerance: float) -> str:
    if value is None:
        return "-"
    mark = "" if abs(value - 1) <= tolerance + 1e-9 else " !"
    return f"{value:.2f}{mark}"


def report_table(results: list[ScenarioResult], args) -> str:
    """Markdown: per scenario the goodput row, then one row per rate (live / planned)."""
    tol = args.tolerance
    lines = [
        f"SLO: TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms for "
        f"{args.attainment:.0%}; simulated time; ratio = live / planned; ! = outside "
        f"±{tol:.0%}; (low–high) = planned attainment (%) and p90 over the rate x "
        f"(1 ± {args.jitter:g})",
        "",
        "| scenario | split | scale | rate req/s | attainment planned / live | "
        "TTFT p90 ms planned / live | ratio | TPOT p90 ms planned / live | ratio | "
        "local prefills planned / live |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        q = ratios(r)
        bound = ">=" if r.live.goodput_is_lower_bound else ""
        lines.append(
            f"| {r.name} | {r.split} | {r.time_scale:g} | goodput {r.planned.goodput:.2f} "
            f"planned (sweep {r.offline_sweep_goodput:.2f}), {bound}{r.live.goodput:.2f} live | "
            f"ratio {within(q['goodput'], tol)} | | | | | |"
        )
        for pp, lp, rq in zip(r.planned.points, r.live.points, q["points"], strict=True):
            lines.append(
                f"| | | | {pp.rate:.2f} | {pp.attainment:.0%}"
                f"{_range([100 * a for a in pp.attainment_range], '.0f')} / "
                f"{lp.attainment:.0%} | "
                f"{pp.ttft_p90_ms:.0f}{_range(pp.ttft_p90_range_ms, '.0f')} / "
                f"{lp.ttft_p90_ms:.0f} | {within(rq['ttft_p90'], tol)} | "
                f"{pp.tpot_p90_ms:.1f}{_range(pp.tpot_p90_range_ms, '.1f')} / "
                f"{lp.tpot_p90_ms:.1f} | {within(rq['tpot_p90'], tol)} | "
                f"{pp.local_prefills:.0%} / {lp.local_prefills:.0%} |"
            )
    for r in results:
        lines.append(
            f"\n{r.name}: offline {r.offline_seconds:.0f} s ({r.search_probes} search probes), "
            f"live {r.live_seconds:.0f} s at time scale {r.time_scale:g}"
        )
    return "\n".join(lines)
