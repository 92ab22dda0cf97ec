"""Serving metrics from known timestamps: TTFT, TPOT, ITL, E2E, percentiles, goodput.

Times are dyadic fractions of a second so that the expected values are exact in binary.
"""

from __future__ import annotations

import math

import pytest

from pdserve.workloads.metrics import (
    LatencyStats,
    RequestRecord,
    meets_slo,
    run_duration,
    summarize,
    summarize_by_tag,
)


def record(
    send: float, chunks: list[tuple[float, int]], *, ok: bool = True, code=None, tag=""
) -> RequestRecord:
    times = [t for t, _ in chunks]
    return RequestRecord(
        index=0,
        request_id="r",
        prompt_len=10,
        max_tokens=sum(n for _, n in chunks),
        tag=tag,
        send_time=send,
        chunk_times=times,
        chunk_tokens=[n for _, n in chunks],
        end_time=(times[-1] if times else send) + 0.0625,
        ok=ok,
        error_code=code,
    )


def test_per_request_latencies_follow_vllm_definitions():
    # Four responses carrying 1, 1, 3 and 1 tokens: 6 tokens, 4 chunks.
    r = record(1.0, [(1.125, 1), (1.25, 1), (1.5, 3), (1.625, 1)])
    assert r.output_tokens == 6
    assert r.ttft == 0.125
    assert r.e2e == 0.625  # send -> last token, not the later stream end
    assert r.tpot == (0.625 - 0.125) / 5
    assert r.itls == [0.125, 0.25, 0.125]  # one gap per response, whatever it carries
    # SGLang's per-token ITL: the 3-token response's gap split over its tokens.
    assert r.token_itls == [0.125, 0.25 / 3, 0.25 / 3, 0.25 / 3, 0.125]


def test_one_token_and_empty_requests_have_no_tpot():
    assert record(0.0, [(0.5, 1)]).tpot is None
    empty = record(0.0, [])
    assert (empty.ttft, empty.e2e, empty.tpot, empty.itls) == (None, None, None, [])
    assert empty.token_itls == [] and record(0.0, [(0.5, 2)]).token_itls == []


def test_percentiles_use_linear_interpolation():
    stats = LatencyStats.of([0.125, 0.25, 0.5, 1.0])  # seconds -> 125, 250, 500, 1000 ms
    assert stats.count == 4
    assert stats.mean == 468.75
    assert stats.p50 == 375.0  # rank 1.5: 250 + 0.5 * 250
    assert stats.p90 == pytest.approx(850.0, abs=1e-9)  # rank 2.7: 500 + 0.7 * 500
    assert stats.p99 == pytest.approx(985.0, abs=1e-9)  # rank 2.97
    assert stats.std == pytest.approx(math.sqrt(112304.6875), abs=1e-9)  # population std
    assert (stats.min, stats.max) == (125.0, 1000.0)
    assert LatencyStats.of([]) == LatencyStats()


def _run() -> list[RequestRecord]:
    return [
        # ttft 100 ms, tpot 50 ms: meets both SLOs below
        record(0.0, [(0.125, 1), (0.1875, 1), (0.25, 1)], tag="short"),
        # ttft 500 ms: misses the TTFT SLO
        record(0.0, [(0.5, 1), (0.5625, 1)], tag="long"),
        # ttft 125 ms, tpot 250 ms: misses the TPOT SLO
        record(0.25, [(0.375, 1), (0.625, 1)], tag="short"),
        # one token: no TPOT, meets any TPOT SLO
        record(0.5, [(0.625, 1)], tag="long"),
        # failed RPCs: counted by code, never in latencies or goodput
        record(1.0, [(1.125, 1)], ok=False, code="RESOURCE_EXHAUSTED", tag="short"),
        record(1.0, [], ok=False, code="RESOURCE_EXHAUSTED", tag="short"),
        record(1.0, [], ok=False, code="UNAVAILABLE", tag="long"),
    ]


def test_summary_counts_throughput_goodput_and_failures():
    summary = summarize(_run(), duration_s=2.0, slo_ttft_ms=200, slo_tpot_ms=100)
    assert (summary.num_requests, summary.completed, summary.failed) == (7, 4, 3)
    assert summary.failures == {"RESOURCE_EXHAUSTED": 2, "UNAVAILABLE": 1}
    assert summary.total_input_tokens == 40
    assert summary.total_output_tokens == 8
    assert summary.request_throughput == 2.0
    assert summary.output_throughput == 4.0
    assert summary.total_token_throughput == 24.0
    assert summary.good_requests == 2  # the first and the one-token request
    assert summary.goodput == 1.0
    assert summary.ttft.count == 4 and summary.ttft.mean == (125 + 500 + 125 + 125) / 4
    assert summary.tpot.count == 3
    assert summary.tpot.max == 250.0
    assert summary.itl.count == 4  # 2 + 1 + 1 + 0 gaps
    assert summary.token_itl.count == sum(len(r.token_itls) for r in _run() if r.ok)
    assert summary.e2e.max == 562.5


def test_goodput_with_one_slo_or_none():
    only_ttft = summarize(_run(), 2.0, slo_ttft_ms=200)
    assert only_ttft.good_requests == 3 and only_ttft.goodput == 1.5
    only_tpot = summarize(_run(), 2.0, slo_tpot_ms=100)
    assert only_tpot.good_requests == 3
    no_slo = summarize(_run(), 2.0)
    assert no_slo.good_requests is None and no_slo.goodput is None
    assert meets_slo(_run()[0], 125, 62.5)  # the SLO bound itself counts as met
    assert not meets_slo(_run()[4], None, None)  # a failed request never does


def test_summary_by_tag_and_duration():
    by_tag = summarize_by_tag(_run(), 2.0)
    assert sorted(by_tag) == ["long", "short"]
    assert (by_tag["short"].completed, by_tag["short"].failed) == (2, 2)
    assert by_tag["long"].failures == {"UNAVAILABLE": 1}
    # First send (0.0) to the last stream end (1.125 + 0.0625).
    assert run_duration(_run()) == 1.1875
    assert summarize([], run_duration([])).request_throughput == 0.0
    with pytest.raises(ValueError):
        summarize(_run(), -1.0)


def test_record_dict_has_derived_metrics():
    d = record(0.0, [(0.125, 1), (0.25, 2)]).to_dict()
    assert (d["ttft"], d["e2e"], d["output_tokens"], d["tpot"]) == (0.125, 0.25, 3, 0.0625)
