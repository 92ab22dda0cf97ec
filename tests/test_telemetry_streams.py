"""Traced grpc.aio response streams that a client cancels end quietly, with their span."""

from __future__ import annotations

import asyncio
import logging

import grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve import telemetry

SERVICE, METHOD = "pdserve.test.Stream", "Ticks"


async def _ticks(request: bytes, context: grpc.aio.ServicerContext):
    for _ in range(100_000):
        yield request
        await asyncio.sleep(0)  # cancels arrive while the generator waits at its yield


async def _cancel_streams(provider: TracerProvider, streams: int) -> None:
    server = grpc.aio.server(interceptors=telemetry.aio_server_interceptors(provider))
    handler = grpc.unary_stream_rpc_method_handler(_ticks)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for _ in range(streams):
                call = channel.unary_stream(f"/{SERVICE}/{METHOD}")(b"tick")
                received = 0
                async for _response in call:
                    received += 1
                    if received == 3:
                        call.cancel()
                        break
        await asyncio.sleep(0.3)  # the server notices the cancels
    finally:
        await server.stop(None)


def test_cancelled_streams_log_nothing_and_end_their_spans(caplog):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with caplog.at_level(logging.WARNING):
        asyncio.run(_cancel_streams(provider, streams=3))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == [f"/{SERVICE}/{METHOD}"] * 3
