"""The rates a validation sweeps: fractions of the planner's goodput, extended until the offline
sweep brackets the goodput, so the live goodput is interpolated between a rate that met the
attainment target and one that did not (`metrics.goodput_rate`), not only bounded.

One sample serves every rate, so attainment over the offline sweep is the Search's curve: the
rate the Search returned met the target and one `precision` above it did not. Fractions that
straddle 1 therefore usually bracket already; a sample whose attainment is not monotone in the
rate (a few long prompts arriving together) may need a rate further out on either side.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.bench.planner_validation.report import RatePoint


def bracketed_sweep(
    probe: Callable[[float], RatePoint],
    goodput: float,
    fractions: list[float],
    target: float,
    step: float = 1.15,
    max_extra: int = 3,
) -> list[RatePoint]:
    """Offline points at `fractions` x `goodput`, in rate order; then, at most `max_extra`
    times, a rate `step` x above the highest while none falls below `target`, or `step` x below
    the lowest while the lowest falls below it."""
    points = [probe(goodput * f) for f in sorted(fractions)]
    for _ in range(max_extra):
        if brackets(points, target):
            break
        if points[0].attainment >= target:  # every rate met it: go higher
            points.append(probe(points[-1].rate * step))
        else:
            points.insert(0, probe(points[0].rate / step))
    return points


def brackets(points: list[RatePoint], target: float) -> bool:
    """Whether the sweep has a rate meeting `target` below its first rate missing it."""
    rates = sorted(points, key=lambda p: p.rate)
    return rates[0].attainment >= target and any(p.attainment < target for p in rates)
