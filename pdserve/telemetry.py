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
- `OTEL_RESOURCE_ATTRIBUTES` adds resource attributes; `service_name` names the process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# Always W3C, whatever OTEL_PROPAGATORS says: these carriers cross our own process
# boundaries (Ray, KV chunks), and both ends must agree on the format.
_PROPAGATOR = TraceContextTextMapPropagator()
CARRIER_KEYS = frozenset(_PROPAGATOR.fields)  # {"traceparent", "tracestate"}
# Probes and reflection would otherwise fill the trace backend with one-span traces.
_UNTRACED_GRPC_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.")

_provider: TracerProvider | None = None


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


def build_tracer_provider(service_name: str) -> TracerProvider:
    """A TracerProvider configured from the environment (not installed globally)."""
    exporters = span_exporters_from_env()
    sampler = None  # the SDK reads OTEL_TRACES_SAMPLER itself
    if not exporters and "OTEL_TRACES_SAMPLER" not in os.environ:
        sampler = ParentBased(root=ALWAYS_OFF)
    provider = TracerProvider(
        sampler=sampler, resource=Resource.create({SERVICE_NAME: service_name})
    )
    for name, exporter in exporters:
        # Console output is for a person watching: show spans as they end.
        processor: SpanProcessor = (
            SimpleSpanProcessor(exporter) if name == "console" else BatchSpanProcessor(exporter)
        )
        provider.add_span_processor(processor)
    return provider


def setup_tracing(service_name: str) -> TracerProvider:
    """Installs the global TracerProvider once per process; later calls return it."""
    global _provider
    if _provider is None:
        _provider = build_tracer_provider(service_name)
        trace.set_tracer_provider(_provider)
    return _provider


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


# --- propagation ---------------------------------------------------------------------------


def inject_context(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """The current (or given) trace context as a W3C carrier; {} when there is no span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


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

    return [aio_server_interceptor(tracer_provider, filter_=_traced_filter())]


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
