"""The plan as `pdserve plan` prints it (a table of the best splits and the recommendation)
and as JSON (every split)."""

from __future__ import annotations

from typing import Any

from pdserve.planner.search import Plan, SplitResult


def plan_table(plan: Plan, context: dict[str, Any], top: int) -> str:
    c = context
    # Several step budgets searched: each split's row names the one it served most at.
    budgets = "  step tokens" if len(c.get("max_num_batched_tokens", ())) > 1 else ""
    lines = [
        f"plan: {c['model']} on {c['gpus']} x {c['gpu']} (tp {c['tp']}, profile {c['profile']}); "
        f"workload {c['workload']}: {c['requests']} requests, probes of "
        f"{c['requests_per_worker']} per simulated worker{_steady(plan, c)}; "
        f"SLO TTFT <= {c['ttft_slo_ms']:g} ms and TPOT <= {c['tpot_slo_ms']:g} ms for "
        f"{c['attainment']:.0%}",
        f"{'split':>14}  {'goodput req/s':>13}  {'per GPU':>8}  {'TTFT p50/p90 ms':>16}  "
        f"{'TPOT p50/p90 ms':>16}  {'GPU util P/D':>12}{budgets}",
    ]
    # The best `top` searched in full (fewer when the others all failed at the bar).
    for result in [r for r in plan.results if not r.pruned][:top]:
        budget = result.max_num_batched_tokens
        lines.append(_row(result) + (f"  {budget:>11}" if budget else ""))
    lines.append(_recommendation(plan))
    pruned = [r.split.name for r in plan.results if r.pruned]
    if pruned:
        lines.append(f"below the best (failed at their lowest goodput): {', '.join(pruned)}")
    bracketed = [r.split.name for r in plan.results if r.below_best]
    if bracketed:
        lines.append(
            "below the best, goodput bracketed only (--bracket-runners-up; without it they are "
            f"searched within the precision): {', '.join(bracketed)}"
        )
    lines += _ceiling(plan, c.get("compute_ceiling"), c["gpus"])
    saturated = [r.split.name for r in plan.results if r.saturated]
    if saturated:
        lines.append(
            f"absorbed the whole probe as a burst (goodput at least the figure shown; raise --requests-per-worker): {', '.join(saturated)}"
        )
    return "\n".join(lines)


def _row(result: SplitResult) -> str:
    gpus = result.split.gpus
    goodput = f"{'>=' if result.saturated else ''}{result.goodput:.2f}"
    if result.below_best:  # passed at goodput, failed at failed_at (the best of the others)
        goodput = f"{result.goodput:.0f}-{result.failed_at:.0f}"
    best = result.best
    if best is None:
        return f"{result.split.name:>14}  {goodput:>13}  {0:>8.3f}  {'-':>16}  {'-':>16}  {'-':>12}"
    util = (
        f"{best.prefill_utilisation:.0%}/{best.decode_utilisation:.0%}"
        if result.split.prefill
        else f"-/{best.decode_utilisation:.0%}"
    )
    return (
        f"{result.split.name:>14}  {goodput:>13}  {result.goodput / gpus:>8.3f}  "
        f"{best.ttft.p50:>7.0f}/{best.ttft.p90:<8.0f}  {best.tpot.p50:>7.1f}/{best.tpot.p90:<8.1f}  "
        f"{util:>12}"
    )


def _steady(plan: Plan, context: dict[str, Any]) -> str:
    """The longer probes of the splits whose passes came near a full batch (Search._probe)."""
    steady = [r.split.name for r in plan.results if r.steady]
    if not steady:
        return ""
    return (
        f" ({context['steady_requests_per_worker']} once a pass came near a full batch: "
        f"{', '.join(steady)})"
    )


def _ceiling(plan: Plan, ceiling: float | None, gpus: int) -> list[str]:
    """The compute ceiling (pdserve/planner/ceiling.py), and the goodputs above it."""
    if ceiling is None:
        return []
    lines = [
        f"compute ceiling: {ceiling:.2f} req/s (this sample's FLOPs on all {gpus} GPUs at the "
        "profile's share of peak: no split serves more)"
    ]
    above = [r.split.name for r in plan.results if r.goodput > ceiling]
    if above:
        lines.append(
            f"above the ceiling, so not sustainable: {', '.join(above)} (their probes ended before "
            "the load built up; raise --requests-per-worker)"
        )
    return lines


def _recommendation(plan: Plan) -> str:
    chosen, best = plan.recommended, plan.best
    if best.goodput == 0:
        return "recommended: none: no split meets the SLOs at any rate searched"
    if chosen.split.prefill == 0:
        if best is chosen:
            return f"recommended: {chosen.split.name} (disaggregation does not pay)"
        return (
            f"recommended: {chosen.split.name} (disaggregation does not pay: the best split, "
            f"{best.split.name}, gains {best.goodput / chosen.goodput - 1:.0%}, within the "
            f"search's precision of {plan.precision:.0%})"
        )
    colocated = next((r for r in plan.results if r.split.prefill == 0), None)
    gain = ""
    if colocated is not None and colocated.goodput > 0:
        gain = f": {chosen.goodput / colocated.goodput:.2f}x the goodput of colocated"
    return f"recommended: {chosen.split.name} (disaggregated{gain})"


def plan_json(plan: Plan, context: dict[str, Any]) -> dict[str, Any]:
    return {
        **context,
        "precision": plan.precision,
        "search_seconds": plan.seconds,
        "probes": plan.probes,
        "recommended": plan.recommended.split.name,
        "splits": [_split_json(r) for r in plan.results],
    }


def _split_json(result: SplitResult) -> dict[str, Any]:
    best = result.best
    return {
        "split": result.split.name,
        "prefill_workers": result.split.prefill,
        "decode_workers": result.split.decode,
        "prefill_tp": result.split.prefill_tp,
        "decode_tp": result.split.decode_tp,
        "estimate": result.estimate,
        "goodput": result.goodput,
        "failed_at": result.failed_at,
        "pruned": result.pruned,
        "saturated": result.saturated,
        "below_best": result.below_best,
        "steady_probes": result.steady,
        "max_num_batched_tokens": result.max_num_batched_tokens,
        "probes": len(result.probes),
        "ttft_ms": None if best is None else {"p50": best.ttft.p50, "p90": best.ttft.p90},
        "tpot_ms": None if best is None else {"p50": best.tpot.p50, "p90": best.tpot.p90},
        "utilisation": None
        if best is None
        else {"prefill": best.prefill_utilisation, "decode": best.decode_utilisation},
    }
