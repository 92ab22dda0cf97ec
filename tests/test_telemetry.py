import asyncio
import io
import json
import logging
import os
import re
import ssl
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve import metrics, telemetry
from pdserve.logging_setup import bind_request_id, setup_logging
from pdserve.tls_files import CertificateFiles
from tests.router.tls_certs import TestCA, certificate_of, install, served_certificate

ECHO_METHOD = "/pdserve.test.Echo/Say"
HEALTH_SERVICE = "grpc.health.v1.Health"


@pytest.fixture
def no_otel_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


@pytest.fixture
def recorded() -> tuple[TracerProvider, InMemorySpanExporter]:
    """A provider that records every span, standing in for one with an exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_context_crosses_a_process_boundary_in_a_carrier(recorded):
    provider, exporter = recorded
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("router.generate") as root:
        carrier = telemetry.inject_context()  # travels in a Ray call / KV chunk header
    assert set(carrier) <= telemetry.CARRIER_KEYS and "traceparent" in carrier
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing leaks: like a new process

    with telemetry.span_from_carrier("decode.generate", carrier, {"rid": "r1"}, tracer=tracer):
        onward = telemetry.inject_context()
    child = next(s for s in exporter.get_finished_spans() if s.name == "decode.generate")
    assert child.context.trace_id == root.get_span_context().trace_id
    assert child.parent.span_id == root.get_span_context().span_id
    assert child.attributes["rid"] == "r1"
    assert f"{root.get_span_context().trace_id:032x}" in onward["traceparent"]


def _sampled(carrier: dict[str, str]) -> bool:
    return bool(int(carrier["traceparent"].rsplit("-", 1)[1], 16) & 1)


def test_without_otel_env_nothing_exports_but_context_still_propagates(no_otel_env):
    assert telemetry.span_exporters_from_env() == []
    provider = telemetry.build_tracer_provider("pdserve-test")
    tracer = provider.get_tracer("test")
    # Root spans cost nothing (not recorded) yet have a trace id to hand on.
    with tracer.start_as_current_span("root") as root:
        assert not root.is_recording()
        assert not _sampled(telemetry.inject_context())
    # A sampled trace from upstream stays sampled through this process.
    upstream = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with telemetry.span_from_carrier("hop", upstream, tracer=tracer) as span:
        assert span.get_span_context().trace_id == 0x0AF7651916CD43DD8448EB211C80319C
        assert _sampled(telemetry.inject_context())
    assert telemetry.setup_tracing("a") is telemetry.setup_tracing("b")


def test_otel_env_selects_exporters(no_otel_env, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    [(name, exporter)] = telemetry.span_exporters_from_env()
    assert name == "otlp" and isinstance(exporter, GrpcExporter)

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console, otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    kinds = [type(e) for _, e in telemetry.span_exporters_from_env()]
    assert kinds == [ConsoleSpanExporter, HttpExporter]

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert telemetry.span_exporters_from_env() == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="zipkin"):
        telemetry.span_exporters_from_env()


def test_grpc_metadata_carrier_keeps_only_trace_context():
    metadata = [
        ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ("authorization", "Bearer secret"),
        ("x-bin", b"\x00"),
    ]
    carrier = telemetry.carrier_from_grpc_metadata(metadata)
    assert list(carrier) == ["traceparent"]
    assert telemetry.grpc_metadata_from_carrier(carrier) == metadata[:1]
    assert telemetry.carrier_from_grpc_metadata(None) == {}


def _echo(request: bytes, context) -> bytes:
    return request


async def _aio_echo(request: bytes, context) -> bytes:
    return request


def _echo_handler(behavior=_echo, service: str = "pdserve.test.Echo") -> grpc.GenericRpcHandler:
    handler = grpc.unary_unary_rpc_method_handler(behavior)
    return grpc.method_handlers_generic_handler(service, {"Say": handler})


def _assert_server_span_is_child_of_client_span(exporter: InMemorySpanExporter) -> None:
    spans = {s.kind: s for s in exporter.get_finished_spans()}
    server, client = spans[trace.SpanKind.SERVER], spans[trace.SpanKind.CLIENT]
    assert server.context.trace_id == client.context.trace_id
    assert server.parent.span_id == client.context.span_id


def test_sync_grpc_interceptors_link_client_and_server_spans(recorded):
    provider, exporter = recorded
    server = grpc.server(
        futures.ThreadPoolExecutor(2), interceptors=telemetry.server_interceptors(provider)
    )
    server.add_generic_rpc_handlers([_echo_handler(), _echo_handler(service=HEALTH_SERVICE)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as raw:
            channel = telemetry.instrument_channel(raw, provider)
            # Probes are not traced: they would bury real traces.
            assert channel.unary_unary(f"/{HEALTH_SERVICE}/Say")(b"ok", timeout=5) == b"ok"
            assert exporter.get_finished_spans() == ()
            assert channel.unary_unary(ECHO_METHOD)(b"hi", timeout=5) == b"hi"
    finally:
        server.stop(None)
    _assert_server_span_is_child_of_client_span(exporter)


def test_aio_grpc_interceptors_link_client_and_server_spans(recorded):
    provider, exporter = recorded

    async def call() -> bytes:
        server = grpc.aio.server(interceptors=telemetry.aio_server_interceptors(provider))
        server.add_generic_rpc_handlers([_echo_handler(_aio_echo)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            interceptors = telemetry.aio_client_interceptors(provider)
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", interceptors=interceptors
            ) as channel:
                return await channel.unary_unary(ECHO_METHOD)(b"hi", timeout=5)
        finally:
            await server.stop(None)

    assert asyncio.run(call()) == b"hi"
    _assert_server_span_is_child_of_client_span(exporter)


@pytest.fixture
def log_stream():
    root = logging.getLogger()
    level = root.level
    handler = setup_logging("INFO", fmt="json")
    stream = io.StringIO()
    handler.setStream(stream)
    yield handler, stream
    root.removeHandler(handler)
    root.setLevel(level)


def test_json_log_lines_carry_request_and_trace_ids(log_stream, recorded):
    _handler, stream = log_stream
    tracer = recorded[0].get_tracer("test")
    with bind_request_id("req-42"), tracer.start_as_current_span("work") as span:
        logging.getLogger("pdserve.test").info("prefill done in %d ms", 12)
    logging.getLogger("pdserve.test").warning("no context")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "prefill done in 12 ms"
    assert first["level"] == "INFO" and first["logger"] == "pdserve.test"
    assert first["request_id"] == "req-42"
    assert first["trace_id"] == f"{span.get_span_context().trace_id:032x}"
    assert "ts" in first
    assert "request_id" not in second and "trace_id" not in second


def test_text_log_lines_name_the_request(log_stream):
    handler, stream = log_stream
    setup_logging("DEBUG", fmt="text").setStream(stream)
    assert handler not in logging.getLogger().handlers  # replaced, not duplicated
    with bind_request_id("req-7"):
        logging.getLogger("pdserve.test").debug("hello")
    assert stream.getvalue().rstrip().endswith("hello [request_id=req-7]")
    with pytest.raises(ValueError, match="yaml"):
        setup_logging(fmt="yaml")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _sample(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_metrics_server_serves_moving_values():
    port = metrics.start_metrics_server(0, addr="127.0.0.1")
    assert port > 0
    before = _scrape(port)
    metrics.REQUESTS.labels(outcome="stop").inc()
    metrics.TTFT_SECONDS.observe(0.2)
    metrics.KV_BLOCKS.labels(worker="decode-0", state="free").set(17)
    metrics.KV_TRANSFER_BYTES.inc(4096)
    after = _scrape(port)
    for series, delta in [
        ('pdserve_requests_total{outcome="stop"}', 1),
        ("pdserve_ttft_seconds_count", 1),
        ('pdserve_ttft_seconds_bucket{le="0.25"}', 1),
        ("pdserve_kv_transfer_bytes_total", 4096),
    ]:
        assert _sample(after, series) - _sample(before, series) == delta, series
    assert _sample(after, 'pdserve_kv_blocks{state="free",worker="decode-0"}') == 17
    for name in ("pdserve_tpot_seconds", "pdserve_itl_seconds", "pdserve_e2e_seconds"):
        assert f"# TYPE {name} histogram" in after
    for name in (
        "pdserve_routing_decisions_total",
        "pdserve_prefix_hit_tokens_total",
        "pdserve_prefix_query_tokens_total",
        "pdserve_kv_transfer_failures_total",
        "pdserve_kv_transfer_seconds",
        "pdserve_queue_length",
        "pdserve_redis_up",
    ):
        assert f"# HELP {name}" in after or f"# HELP {name.removesuffix('_total')}" in after


def test_setup_tracing_rereads_the_exporter_variables(no_otel_env, monkeypatch):
    # One process that serves twice (tests, `pdserve bench tracing`): off, on, off again.
    provider = telemetry.setup_tracing("pdserve-test")
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("off") as span:
        assert not span.is_recording()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert telemetry.setup_tracing("pdserve-test") is provider
    with tracer.start_as_current_span("exported-root") as span:
        assert span.is_recording() and _sampled(telemetry.inject_context())
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    telemetry.setup_tracing("pdserve-test")
    with tracer.start_as_current_span("off-again") as span:
        assert not span.is_recording()
    assert telemetry.flush_tracing()


@pytest.mark.parametrize(
    "error, reason",
    [
        ("KV endpoint h:1: DEADLINE_EXCEEDED: slow", "timeout"),
        ("KV endpoint h:1: DATA_LOSS: transfer t: chunk 0 checksum mismatch", "checksum"),
        ("KV endpoint h:1: UNAVAILABLE: connection refused", "connection"),
        ("KV endpoint h:1: FAILED_PRECONDITION: transfer t is not open", "rejected"),
        ("prefill-0: ActorDiedError: the actor died", "worker_died"),
        (RuntimeError("something else"), "other"),
    ],
)
def test_transfer_failures_are_labelled_by_reason(error, reason):
    assert metrics.transfer_failure_reason(error) == reason


def test_a_request_observation_feeds_the_latency_histograms(no_otel_env):
    from router.observability import RequestObserver
    from router.types import Progress

    def count(name: str, labels: dict | None = None) -> float:
        from prometheus_client import REGISTRY

        return REGISTRY.get_sample_value(name, labels) or 0.0

    names = ["pdserve_ttft_seconds_count", "pdserve_itl_seconds_count",
             "pdserve_tpot_seconds_count", "pdserve_e2e_seconds_count"]  # fmt: skip
    before = [count(n) for n in names] + [count("pdserve_requests_total", {"outcome": "length"})]
    progress = Progress(received=100.0, prompt_tokens=8)
    observation = RequestObserver().start("r1", {}, progress)
    assert "traceparent" in observation.trace_context
    progress.first_token_at = 100.2
    observation.on_tokens(1, 100.2)
    progress.completion_tokens = 3
    observation.on_tokens(2, 100.3)
    observation.finish("length", None)
    observation.finish("length", None)  # idempotent
    after = [count(n) for n in names] + [count("pdserve_requests_total", {"outcome": "length"})]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1, 1, 1]


def test_metrics_over_tls_refuse_plaintext_and_strangers_and_follow_renewal(tmp_path):
    ca = TestCA(tmp_path)
    first, renewed = ca.issue("router", server=True), ca.issue("router-renewed", server=True)
    scraper = ca.issue("prometheus", server=False)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    install(first, cert, key)
    tls = CertificateFiles(cert, key, ca.cert, what="metrics port")
    port = metrics.start_metrics_server(0, addr="127.0.0.1", tls=tls)
    try:
        url = f"https://127.0.0.1:{port}/metrics"
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            _scrape(port)  # plaintext
        context = ssl.create_default_context(cafile=ca.cert)
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, timeout=5, context=context).read()  # no certificate
        context.load_cert_chain(scraper.cert, scraper.key)
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            assert b"pdserve_requests_total" in response.read()
        assert served_certificate(port, scraper) == certificate_of(first)
        install(renewed, cert, key)
        assert served_certificate(port, scraper) == certificate_of(renewed)
    finally:
        metrics.stop_metrics_server(port)
