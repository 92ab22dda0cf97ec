"""Arrival schedules (statistics, reproducibility) and the load generator against a real server."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from pdserve.bench.common.load_generator import arrival_times, run_load
from pdserve.workloads.datasets import BenchRequest
from pdserve.workloads.metrics import summarize
from tests.bench.echo_server import EchoServer, EchoServicer


def test_schedule_is_reproducible_and_starts_at_zero():
    schedule = arrival_times(100, request_rate=5.0, burstiness=0.5, seed=11)
    assert schedule == arrival_times(100, 5.0, 0.5, seed=11)
    assert schedule != arrival_times(100, 5.0, 0.5, seed=12)
    assert schedule[0] == 0.0 and len(schedule) == 100
    assert all(b >= a for a, b in zip(schedule, schedule[1:], strict=False))
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_times(0, 1.0) == []


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_schedule_has_the_requested_rate_and_burstiness(burstiness):
    rate, n = 10.0, 50_000
    gaps = np.diff(arrival_times(n, rate, burstiness, seed=0))
    # Mean gap 1/rate; coefficient of variation 1/sqrt(shape) (1 for Poisson).
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_schedule_rejects_bad_rates():
    with pytest.raises(ValueError):
        arrival_times(10, 0.0)
    with pytest.raises(ValueError):
        arrival_times(10, 1.0, burstiness=0.0)


def _requests(n: int, output_len: int = 6) -> list[BenchRequest]:
    return [BenchRequest([i + 1, i + 2, i + 3], 3, output_len, tag=f"t{i % 2}") for i in range(n)]


def test_records_carry_client_timestamps_per_response():
    servicer = EchoServicer(first_token_delay_s=0.02, token_delay_s=0.005, tokens_per_chunk=2)
    with EchoServer(servicer) as server:
        records = asyncio.run(run_load(server.target, _requests(8), request_rate=200.0, seed=1))
    assert [r.index for r in records] == list(range(8))
    assert all(r.ok and r.finish_reason == "length" for r in records)
    for r in records:
        assert r.chunk_tokens == [2, 2, 2] and r.output_tokens == 6
        # A response cannot arrive before the server produced it (gaps themselves jitter).
        assert r.ttft >= 0.02 and r.e2e >= 0.03 and len(r.itls) == 2
        assert r.send_time <= r.chunk_times[0] <= r.end_time
        assert r.server_timings["decode_worker"] == "decode-0"
    sent = [request.sampling for request in servicer.requests]
    assert all(s.max_tokens == 6 and s.ignore_eos for s in sent)
    assert len({request.request_id for request in servicer.requests}) == 8


def test_open_loop_never_sends_early():
    rate, n = 100.0, 20
    with EchoServer() as server:
        # The schedule starts after this (run_load's own clock, inside asyncio.run). Measured
        # from the first send instead, a first request that ran late (its task waits for the
        # loop, and it imports the client) made the ones on time look early (failed in CI).
        before = time.perf_counter()
        records = asyncio.run(run_load(server.target, _requests(n, 1), request_rate=rate, seed=4))
    offsets = arrival_times(n, rate, seed=4)
    assert all(
        r.send_time - before >= offset - 1e-3 for r, offset in zip(records, offsets, strict=True)
    )


def test_closed_loop_keeps_at_most_max_concurrency_in_flight():
    with EchoServer(EchoServicer(token_delay_s=0.002)) as server:
        records = asyncio.run(run_load(server.target, _requests(12), max_concurrency=3))
    assert all(r.ok for r in records)
    events = sorted([(r.send_time, 1) for r in records] + [(r.end_time, -1) for r in records])
    in_flight = np.cumsum([delta for _, delta in events])
    assert in_flight.max() == 3


def test_failures_are_recorded_with_their_status_code():
    requests = [*_requests(3, 2), BenchRequest("fail on purpose", 3, 2)]
    with EchoServer() as server:
        records = asyncio.run(run_load(server.target, requests))
    assert [r.ok for r in records] == [True, True, True, False]
    assert records[3].error_code == "INVALID_ARGUMENT"
    assert summarize(records, 1.0).failures == {"INVALID_ARGUMENT": 1}

    unreachable = asyncio.run(run_load("127.0.0.1:1", _requests(2), timeout=5))
    assert [r.error_code for r in unreachable] == ["UNAVAILABLE", "UNAVAILABLE"]
