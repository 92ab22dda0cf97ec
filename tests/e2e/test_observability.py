"""Observability of the served system: one trace per request across router, prefill, transfer
and decode (exported over OTLP/gRPC to a receiver in this process), and Prometheus metrics of
the router and a worker that move as requests are served."""

from __future__ import annotations

import os
import re
import secrets
import time
import urllib.request

import pytest

from pdserve import telemetry
from pdserve.bench.serving.span_receiver import ReceivedSpan, SpanReceiver
from tests.e2e.conftest import serve_config
from tests.e2e.test_disaggregated_serving import VOCAB_LOW, collect, request

SERVER_SPAN = "/pdserve.v1.Generation/Generate"
# Every span of a disaggregated request, by the process that records it.
ROUTER_SPANS = {SERVER_SPAN, "pdserve.generate", "pdserve.first_token", "pdserve.attempt",
                "pdserve.route"}  # fmt: skip
PREFILL_SPANS = {"pdserve.prefill", "pdserve.prefill.queue", "pdserve.prefill.forward",
                 "pdserve.kv_transfer"}  # fmt: skip
DECODE_SPANS = {"pdserve.decode.reserve", "pdserve.kv_receive", "pdserve.decode.admit",
                "pdserve.decode"}  # fmt: skip


@pytest.fixture(scope="module")
def receiver():
    receiver = SpanReceiver()
    endpoint = receiver.start()
    yield receiver, endpoint
    receiver.stop()


@pytest.fixture(scope="module")
def served(ray_cluster, receiver):
    from pdserve.app import BackgroundApp

    _, endpoint = receiver
    # Read by this process's router and forwarded to the worker actors (pdserve/worker/pools.py).
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        config = serve_config("grpc", prefill_workers=1, decode_workers=1, metrics_port=0)
        config.worker.metrics_port = 0
        with BackgroundApp(config) as app:
            yield app
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        telemetry.setup_tracing("pdserve-router")  # this process exports as before again


def _parents(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> list[str]:
    """Names of the span's ancestors in the trace, nearest first."""
    names = []
    while span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        names.append(span.name)
    return names


def test_one_trace_covers_router_prefill_transfer_and_decode(served, stub, receiver):
    spans_in, _ = receiver
    trace_id, client_span_id = secrets.token_hex(16), secrets.token_hex(8)
    req = request(list(range(VOCAB_LOW, VOCAB_LOW + 30)), 5)
    req.request_id = "observed-request"
    _, responses = collect(
        stub, req, metadata=[("traceparent", f"00-{trace_id}-{client_span_id}-01")]
    )
    assert responses[-1].timings.disaggregated

    wanted = ROUTER_SPANS | PREFILL_SPANS | DECODE_SPANS
    spans = spans_in.wait_for(lambda got: wanted <= {s.name for s in got if s.trace_id == trace_id})
    mine = [s for s in spans if s.trace_id == trace_id]
    assert wanted <= {s.name for s in mine}, sorted(wanted - {s.name for s in mine})
    by_id = {s.span_id: s for s in mine}
    span = {s.name: s for s in mine}  # one of each for this request (no retries)

    # The router's first span continues the client's; everything else hangs below it.
    assert span[SERVER_SPAN].parent_span_id == client_span_id
    for name in wanted - {SERVER_SPAN}:
        assert SERVER_SPAN in _parents(span[name], by_id), name
    # Three processes: the workers name themselves.
    assert {span[n].service for n in PREFILL_SPANS} == {"pdserve-prefill"}
    assert {span[n].service for n in DECODE_SPANS} == {"pdserve-decode"}
    assert span[SERVER_SPAN].service not in ("pdserve-prefill", "pdserve-decode")
    # Parent links across the Ray calls and the KV chunk headers / commit.
    assert _parents(span["pdserve.prefill"], by_id)[:2] == ["pdserve.attempt", "pdserve.generate"]
    assert _parents(span["pdserve.decode"], by_id)[0] == "pdserve.attempt"
    assert _parents(span["pdserve.decode.admit"], by_id)[:3] == [
        "pdserve.kv_receive", "pdserve.kv_transfer", "pdserve.prefill"]  # fmt: skip
    reserve, receive = span["pdserve.decode.reserve"], span["pdserve.kv_receive"]
    assert (trace_id, reserve.span_id) in receive.links
    # Receiving starts with the first chunk: inside the transfer (one machine, one clock).
    assert span["pdserve.kv_transfer"].start_ns <= receive.start_ns <= receive.end_ns

    generate = span["pdserve.generate"].attributes
    assert generate["pdserve.request_id"] == "observed-request"
    assert generate["pdserve.completion_tokens"] == 5
    assert generate["pdserve.finish_reason"] == "length"
    assert generate["pdserve.prefill_worker"] == "prefill-0"
    route = span["pdserve.route"].attributes
    assert route["pdserve.route.decision"] == "remote"
    assert (route["pdserve.route.prefill_worker"], route["pdserve.route.decode_worker"]) == (
        "prefill-0", "decode-0")  # fmt: skip
    assert sorted(route["pdserve.route.candidates"]) == ["decode-0", "prefill-0"]
    assert len(route["pdserve.route.candidate_cached_tokens"]) == 2
    assert "pdserve.route.estimate.ttft_s" in route
    attempt = span["pdserve.attempt"].attributes
    assert (attempt["pdserve.attempt"], attempt["pdserve.outcome"]) == (1, "ok")
    transfer = span["pdserve.kv_transfer"].attributes
    assert transfer["pdserve.kv.outcome"] == "ok" and transfer["pdserve.kv.transport"] == "grpc"
    assert transfer["pdserve.kv.bytes"] > 0 and transfer["pdserve.kv.chunks"] >= 1
    assert span["pdserve.kv_receive"].attributes["pdserve.kv.bytes"] == transfer["pdserve.kv.bytes"]
    assert span["pdserve.decode"].attributes["pdserve.completion_tokens"] == 4  # 1 from prefill
    assert "pdserve.first_token" in span["pdserve.decode"].events


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _value(text: str, series: str) -> float | None:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def test_router_and_worker_metrics_move_as_requests_are_served(served, stub):
    import ray

    router_port = served.app.metrics_port
    prefill = served.app.pool.workers["prefill-0"].actor
    worker_port = ray.get(prefill.ready.remote())["metrics_port"]
    assert router_port and worker_port
    before = {"router": _scrape(router_port), "worker": _scrape(worker_port)}

    prefix = list(range(VOCAB_LOW + 100, VOCAB_LOW + 140))  # shared: later requests hit the cache
    for i in range(3):
        collect(stub, request(prefix + [VOCAB_LOW + i], 6))
    time.sleep(0.6)  # two stats polls: the gauges follow the workers
    after = {"router": _scrape(router_port), "worker": _scrape(worker_port)}

    def grew(where: str, series: str) -> float:
        return (_value(after[where], series) or 0.0) - (_value(before[where], series) or 0.0)

    for series in ("pdserve_ttft_seconds_count", "pdserve_tpot_seconds_count",
                   "pdserve_e2e_seconds_count", 'pdserve_requests_total{outcome="length"}',
                   'pdserve_routing_decisions_total{decision="remote"}',
                   "pdserve_kv_transfer_seconds_count"):  # fmt: skip
        assert grew("router", series) == 3, series
    assert grew("router", "pdserve_itl_seconds_count") >= 3  # 5 more tokens per request
    assert grew("router", "pdserve_prefix_query_tokens_total") == 3 * 41
    assert grew("router", "pdserve_prefix_hit_tokens_total") > 0
    assert grew("router", "pdserve_kv_transfer_bytes_total") > 0
    # The worker counts its own side of each transfer.
    assert grew("worker", "pdserve_kv_transfer_seconds_count") == 3
    assert grew("worker", "pdserve_kv_transfer_bytes_total") == grew(
        "router", "pdserve_kv_transfer_bytes_total"
    )
    # Gauges: the router shows every worker, a worker itself; both agree with its stats.
    stats = ray.get(prefill.stats.remote())
    for where in ("router", "worker"):
        text = after[where]
        free = _value(text, 'pdserve_kv_blocks{state="free",worker="prefill-0"}')
        assert free == stats.num_free_blocks, where
        assert _value(text, 'pdserve_kv_blocks{state="used",worker="prefill-0"}') == 0
        assert _value(text, 'pdserve_queue_length{worker="prefill-0"}') == 0
        assert _value(text, 'pdserve_prefix_hit_ratio{worker="prefill-0"}') > 0
    assert _value(after["router"], 'pdserve_kv_blocks{state="free",worker="decode-0"}') > 0
