"""OpenTelemetry tracing: setup from `OTEL_*` variables, W3C trace-context propagation, gRPC.

One trace covers a request's whole life: the router starts it, and the context travels as a
W3C `traceparent`/`tracestate` carrier dict in Ray call arguments, in KV-transfer chunk
headers and in gRPC metadata. Each process calls `setup_tracing` once at start.

Exporters follow the standard variables:
- `OTEL_TRACES_EXPORTER`: comma list of `otlp`, `console`, `none`. When unset, `otlp` is
  used only if an OTLP endpoint (`OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT`) is set, so a laptop
  run with no OTEL variables exports nothing.
- `OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`: `grpc` (default) or `http/protobuf`; endpoint,
  headers, TLS and timeout are read by the OTLP exporters themselves.
- `OTEL_TRACES_SAMPLER[_ARG]`: as the SDK defines them. With no exporter and no sampler
  set, root spans are not sampled (no recording cost) but still carry a trace id, and a
  sampled parent from upstream is honoured, so propagation through this process works.
- `OTEL_RESOURCE_ATTRIBUTES` adds resource attributes. The process's role
  (`pdserve-router`, `pdserve-prefill`, `pdserve-decode`) is the service name unless
  `OTEL_SERVICE_NAME` is set; the role is always in the `pdserve.role` attribute.

A later `setup_tracing` call in the same process re-reads the exporter variables (a test or a
benchmark that serves twice in one process, with tracing off and then on): the global provider
can be installed only once, so its exporters sit behind one switchable span processor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ParentBased,
    Sampler,
    SamplingResult,
    _get_from_env_or_default,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve.grpc_handlers import behavior_of, rewrap, write_all

# Always W3C, whatever OTEL_PROPAGATORS says: these carriers cross our own process
# boundaries (Ray, KV chunks), and both ends must agree on the format.
_PROPAGATOR = TraceContextTextMapPropagator()
CARRIER_KEYS = frozenset(_PROPAGATOR.fields)  # {"traceparent", "tracestate"}
# Probes and reflection would otherwise fill the trace backend with one-span traces.
_UNTRACED_GRPC_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.")

_provider: TracerProvider | None = None
_slot: _ExporterSlot | None = None


def _env(name: str, signal_name: str) -> str | None:
    """The per-signal variable wins over the generic one, as the spec says."""
    return os.environ.get(signal_name) or os.environ.get(name)


def span_exporters_from_env() -> list[tuple[str, SpanExporter]]:
    """The (name, exporter) pairs that the `OTEL_*` variables ask for; [] for none."""
    names = os.environ.get("OTEL_TRACES_EXPORTER")
    if names is None:
        endpoint = _env("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        names = "otlp" if endpoint else "none"
    exporters: list[tuple[str, SpanExporter]] = []
    for name in (n.strip().lower() for n in names.split(",") if n.strip()):
        if name == "none":
            continue
        if name == "console":
            exporters.append((name, ConsoleSpanExporter()))
        elif name == "otlp":
            exporters.append((name, _otlp_exporter()))
        else:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER={names!r}: unsupported exporter {name!r} "
                "(use otlp, console or none)"
            )
    return exporters


def _otlp_exporter() -> SpanExporter:
    protocol = _env("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or "grpc"
    # Imported lazily: each exporter pulls in its transport stack.
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )

        return HTTPSpanExporter()
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported (use grpc or http/protobuf)"
    )


class _ExporterSlot(SpanProcessor):
    """Forwards ended spans to the processors of the exporters the environment asks for;
    `configure` swaps them (flushing the old ones), as often as the environment changes."""

    def __init__(self) -> None:
        self._key: tuple[str, ...] | None = None
        self._processors: tuple[SpanProcessor, ...] = ()

    @property
    def exporting(self) -> bool:
        return bool(self._processors)

    def configure(self) -> None:
        key = _exporter_env_key()
        if key == self._key:
            return
        old = self._processors
        # Console output is for a person watching: show spans as they end.
        self._processors = tuple(
            SimpleSpanProcessor(exporter) if name == "console" else BatchSpanProcessor(exporter)
            for name, exporter in span_exporters_from_env()
        )
        self._key = key
        for processor in old:
            processor.shutdown()  # flushes what it still holds

    def on_start(self, span: SdkSpan, parent_context: otel_context.Context | None = None) -> None:
        for processor in self._processors:
            processor.on_start(span, parent_context=parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        for processor in self._processors:
            processor.on_end(span)

    def shutdown(self) -> None:
        for processor in self._processors:
            processor.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(p.force_flush(timeout_millis) for p in self._processors)


def _exporter_env_key() -> tuple[str, ...]:
    names = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")  # fmt: skip
    return tuple(os.environ.get(name, "") for name in names)


class _SampleWhileExporting(Sampler):
    """The SDK's sampler (from OTEL_TRACES_SAMPLER, default parent-based always-on) while an
    exporter is configured; otherwise root spans are dropped, so a process that exports
    nothing records nothing, yet still honours a sampled parent from upstream."""

    def __init__(self, slot: _ExporterSlot) -> None:
        self._slot = slot
        # The SDK's own reading of OTEL_TRACES_SAMPLER[_ARG] (what TracerProvider() would use).
        self._exporting = _get_from_env_or_default()
        self._idle = (
            self._exporting if "OTEL_TRACES_SAMPLER" in os.environ else ParentBased(ALWAYS_OFF)
        )

    def should_sample(
        self,
        parent_context: otel_context.Context | None,
        trace_id: int,
        name: str,
        kind: trace.SpanKind | None = None,
        attributes: Any = None,
        links: Sequence[trace.Link] | None = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        sampler = self._exporting if self._slot.exporting else self._idle
        return sampler.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"SampleWhileExporting({self._exporting.get_description()})"


def build_tracer_provider(service_name: str) -> TracerProvider:
    """A TracerProvider configured from the environment (not installed globally)."""
    return _build(service_name)[0]


def _build(service_name: str) -> tuple[TracerProvider, _ExporterSlot]:
    slot = _ExporterSlot()
    slot.configure()
    provider = TracerProvider(
        sampler=_SampleWhileExporting(slot),
        # Explicit attributes win over the environment's in Resource.create, so honour
        # OTEL_SERVICE_NAME here; the role stays queryable either way.
        resource=Resource.create(
            {
                SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name,
                "pdserve.role": service_name.removeprefix("pdserve-"),
            }
        ),
    )
    provider.add_span_processor(slot)
    return provider, slot


def setup_tracing(service_name: str) -> TracerProvider:
    """Installs the global TracerProvider once per process and returns it; a later call
    returns the same provider (the first service name stays) with its exporters re-read
    from the environment."""
    global _provider, _slot
    if _provider is None or _slot is None:
        _provider, _slot = _build(service_name)
        trace.set_tracer_provider(_provider)
    else:
        _slot.configure()
    return _provider


def flush_tracing(timeout_s: float = 5.0) -> bool:
    """Exports the spans this process still holds (before it stops, or before a test looks)."""
    return _provider is None or _provider.force_flush(int(timeout_s * 1000))


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


# --- propagation ---------------------------------------------------------------------------


def inject_context(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """The current (or given) trace context as a W3C carrier; {} when there is no span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def carrier_of(span: trace.Span) -> dict[str, str]:
    """The W3C carrier that makes a remote span a child of `span`."""
    return inject_context(trace.set_span_in_context(span))


def wall_ns(perf_time: float) -> int:
    """A `time.perf_counter()` reading as span timestamps take it: ns since the epoch."""
    return time.time_ns() - int((time.perf_counter() - perf_time) * 1e9)


def extract_context(carrier: Mapping[str, str] | None) -> otel_context.Context:
    """The context a carrier describes, on top of the current one (so an empty or missing
    carrier means "continue the current trace", not "start a new one")."""
    return _PROPAGATOR.extract(dict(carrier or {}))


@contextmanager
def span_from_carrier(
    name: str,
    carrier: Mapping[str, str] | None,
    attributes: Mapping[str, Any] | None = None,
    kind: trace.SpanKind = trace.SpanKind.SERVER,
    tracer: trace.Tracer | None = None,
) -> Iterator[trace.Span]:
    """Starts the current span `name` as a child of the remote context in `carrier`
    (the receiving side of a Ray call or a KV transfer)."""
    tracer = tracer or get_tracer("pdserve")
    with tracer.start_as_current_span(
        name, context=extract_context(carrier), kind=kind, attributes=dict(attributes or {})
    ) as span:
        yield span


def carrier_from_grpc_metadata(
    metadata: Iterable[tuple[str, str | bytes]] | None,
) -> dict[str, str]:
    """The trace-context entries of gRPC invocation metadata (sync or aio)."""
    return {
        key.lower(): value
        for key, value in metadata or ()
        if key.lower() in CARRIER_KEYS and isinstance(value, str)
    }


def grpc_metadata_from_carrier(carrier: Mapping[str, str] | None) -> list[tuple[str, str]]:
    """Metadata entries for an outgoing gRPC call made on behalf of `carrier`'s trace."""
    return [(k, v) for k, v in (carrier or {}).items() if k in CARRIER_KEYS]


# --- gRPC instrumentation ------------------------------------------------------------------


def _traced_filter() -> Any:
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(*map(filters.service_prefix, _UNTRACED_GRPC_SERVICES)))


# Each takes an optional TracerProvider; None means the global one `setup_tracing` installed.


def aio_server_interceptors(
    tracer_provider: TracerProvider | None = None,
) -> list[grpc.aio.ServerInterceptor]:
    """For `grpc.aio.server(interceptors=...)`: one SERVER span per RPC, parented by the
    caller's `traceparent` metadata."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [
        _StreamsEndInTheirTask(),
        aio_server_interceptor(tracer_provider, filter_=_traced_filter()),
    ]


class _StreamsEndInTheirTask(grpc.aio.ServerInterceptor):
    """Runs every response stream to its end (or its cancel) inside the RPC's task, so the
    instrumentation's span context is detached where it was attached (see `write_all`)."""

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or not handler.response_streaming:
            return handler
        serve = behavior_of(handler)

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> None:
            await write_all(serve(request, context), context)

        return rewrap(handler, behavior)


def server_interceptors(
    tracer_provider: TracerProvider | None = None,
) -> list[grpc.ServerInterceptor]:
    """For `grpc.server(..., interceptors=...)` (thread-pool servers)."""
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor(tracer_provider, filter_=_traced_filter())]


def aio_client_interceptors(
    tracer_provider: TracerProvider | None = None,
) -> list[grpc.aio.ClientInterceptor]:
    """For `grpc.aio.insecure_channel(target, interceptors=...)`: a CLIENT span per call and
    the trace context sent as metadata."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors as make

    return make(tracer_provider, filter_=_traced_filter())


def instrument_channel(
    channel: grpc.Channel, tracer_provider: TracerProvider | None = None
) -> grpc.Channel:
    """Wraps a sync channel so that its calls carry the trace context."""
    from opentelemetry.instrumentation.grpc import client_interceptor
    from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

    # The instrumentation's own channel wrapper: its interceptor is not a grpc.*Interceptor.
    return intercept_channel(channel, client_interceptor(tracer_provider, filter_=_traced_filter()))
