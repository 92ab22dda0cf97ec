"""An OTLP/gRPC trace receiver in this process: what a collector would see, for tests and the
tracing benchmark. `SpanReceiver().start()` -> its endpoint; point `OTEL_EXPORTER_OTLP_ENDPOINT`
at it (protocol grpc) and every process's spans arrive here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    """One exported span, flattened: ids as hex, attributes as Python values."""

    service: str  # resource service.name: which process sent it
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace_id, span_id)


class SpanReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects spans (`keep=True`) or only counts them (benchmarks: a collector's cost)."""

    def __init__(self, keep: bool = True) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self.spans: list[ReceivedSpan] = []
        self.count = 0
        self._server: grpc.Server | None = None

    def start(self, host: str = "127.0.0.1") -> str:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()
        return f"{host}:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None)

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        spans = [
            (rs, s) for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans
        ]
        received = [_flatten(rs, s) for rs, s in spans] if self._keep else []
        with self._lock:
            self.count += len(spans)
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0
    ) -> list[ReceivedSpan]:
        """Polls until `predicate(spans)` holds (exporters batch: spans trickle in); returns
        the spans, whether or not it came to hold."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


def _flatten(resource_spans, span) -> ReceivedSpan:
    resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
    return ReceivedSpan(
        service=str(resource.get("service.name", "")),
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        kind=span.kind,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        attributes={a.key: _value(a.value) for a in span.attributes},
        events=[e.name for e in span.events],
        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
    )


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None
