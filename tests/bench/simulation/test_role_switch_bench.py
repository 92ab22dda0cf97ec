"""`bench sim-role-switching`'s parts: the goodput bisection and the phase-shaped trace."""

from __future__ import annotations

import pytest

from pdserve.bench.simulation.disagg_suite.workloads import suite_sample
from pdserve.bench.simulation.role_switch_bench import bisect_goodput, shaped


@pytest.mark.parametrize("knee", [0.3, 3.7, 9.9, 40.0])
def test_the_bisection_brackets_the_knee_within_the_precision(knee):
    goodput, probes = bisect_goodput(lambda rate: rate <= knee, start=4.0, precision=0.05)
    assert goodput <= knee < goodput * 1.05
    assert probes < 30


def test_nothing_passing_is_zero_goodput():
    assert bisect_goodput(lambda rate: False, start=4.0, precision=0.1)[0] == 0.0


def test_a_phase_rate_stretches_only_that_phases_gaps():
    trace = suite_sample("phases", 200, 0)
    slow_rag = shaped(trace, "rag=0.5")
    gaps = {}
    for before, after in ((trace, "plain"), (slow_rag, "shaped")):
        arrivals = [r.unit_arrival for r in before]
        for r, previous in zip(before[1:], arrivals, strict=False):
            kind = r.tag.split(":")[0]
            gaps.setdefault((after, kind), []).append(r.unit_arrival - previous)
    for kind in ("chat", "code", "agentic"):
        assert sum(gaps[("shaped", kind)]) == pytest.approx(sum(gaps[("plain", kind)]))
    assert sum(gaps[("shaped", "rag")]) == pytest.approx(2 * sum(gaps[("plain", "rag")]))
    assert [r.index for r in slow_rag] == [r.index for r in trace]
    with pytest.raises(ValueError, match="--phase-rates 'video=2'"):
        shaped(trace, "video=2")
