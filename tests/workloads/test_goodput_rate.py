"""DistServe's goodput of a rate sweep, and the SLO attainment it is read from."""

from __future__ import annotations

import pytest

from pdserve.workloads.metrics import RequestRecord, goodput_rate, slo_attainment


def test_goodput_interpolates_the_first_crossing_of_the_target():
    assert goodput_rate({10: 1.0, 20: 0.95, 30: 0.85, 40: 0.2}) == pytest.approx(25.0)
    # A later recovery above the target is noise, not capacity.
    assert goodput_rate({10: 0.95, 20: 0.5, 30: 0.95}) == pytest.approx(10 + 10 * 0.05 / 0.45)


def test_goodput_edges():
    assert goodput_rate({10: 0.99, 20: 0.91}) == 20  # never below: the highest rate swept
    assert goodput_rate({10: 0.9, 20: 0.1}) == 10  # exactly at the target still passes
    assert goodput_rate({10: 0.5}) == pytest.approx(10 * 0.1 / 0.5)  # from (0, 100 %)
    assert goodput_rate({}) == 0.0


def _record(ok: bool, ttft: float, tpot: float, tokens: int = 11) -> RequestRecord:
    record = RequestRecord(0, "r", prompt_len=8, max_tokens=tokens, ok=ok, send_time=0.0)
    record.chunk_times = [ttft + i * tpot for i in range(tokens)]
    record.chunk_tokens = [1] * tokens
    return record


def test_attainment_counts_failed_requests_as_misses():
    records = [
        _record(True, 0.1, 0.01),
        _record(True, 0.5, 0.01),  # TTFT miss
        _record(True, 0.1, 0.05),  # TPOT miss
        _record(False, 0.1, 0.01),  # failed
    ]
    assert slo_attainment(records, 400, 40) == 0.25
    assert slo_attainment([], 400, 40) == 0.0
