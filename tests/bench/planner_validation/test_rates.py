"""The validation's rates bracket the goodput: extended up while every rate met the target,
down while the lowest missed it, at most `max_extra` times."""

from __future__ import annotations

import pytest

from pdserve.bench.planner_validation.rates import bracketed_sweep, brackets
from pdserve.bench.planner_validation.report import RatePoint
from pdserve.workloads.metrics import goodput_rate


def _probe_with_knee(knee: float, probed: list[float]):
    """Attainment 1 up to the knee, then falling by 0.2 for every 10% above it."""

    def probe(rate: float) -> RatePoint:
        probed.append(rate)
        attainment = 1.0 if rate <= knee else max(0.0, 1.0 - 2.0 * (rate - knee) / knee)
        return RatePoint(rate, attainment, 10, 0.0, 0.0, 0.0)

    return probe


def test_fractions_that_straddle_the_knee_are_not_extended():
    probed: list[float] = []
    points = bracketed_sweep(_probe_with_knee(10.0, probed), 10.0, [1.1, 0.7, 0.95], 0.9)
    assert probed == pytest.approx([7.0, 9.5, 11.0])
    assert [p.rate for p in points] == sorted(p.rate for p in points)
    assert brackets(points, 0.9)


def test_a_sweep_that_never_misses_is_extended_upward_until_one_does():
    probed: list[float] = []
    points = bracketed_sweep(_probe_with_knee(14.0, probed), 10.0, [0.7, 1.1], 0.9)
    # 11, 12.65 and 14.55 (0.92) meet the target, 16.73 does not
    assert probed[:2] == pytest.approx([7.0, 11.0])
    assert probed[2:] == pytest.approx([12.65, 14.5475, 16.729625])
    assert points[-1].attainment < 0.9 and brackets(points, 0.9)
    goodput = goodput_rate({p.rate: p.attainment for p in points}, 0.9)
    assert 14.5475 < goodput < 16.729625  # interpolated, not the highest rate as a bound


def test_a_lowest_rate_that_misses_is_extended_downward():
    probed: list[float] = []
    points = bracketed_sweep(_probe_with_knee(5.0, probed), 10.0, [0.7, 1.1], 0.9)
    assert probed[2:] == pytest.approx([7.0 / 1.15, 7.0 / 1.15**2, 7.0 / 1.15**3])
    assert [p.rate for p in points] == sorted(probed)
    assert brackets(points, 0.9)


def test_extension_stops_after_max_extra_rates():
    probed: list[float] = []
    points = bracketed_sweep(_probe_with_knee(100.0, probed), 10.0, [1.0], 0.9, max_extra=2)
    assert len(points) == 3 and not brackets(points, 0.9)
