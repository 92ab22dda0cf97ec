"""Building blocks of grpc.aio server interceptors: rewrap a method handler, drive a stream.

An interceptor that wants to run code around a method gets the method's `RpcMethodHandler`
and returns another of the same shape; these helpers do that without caring which of the four
shapes it is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc

Behavior = Callable[..., Any]  # (request or request iterator, context) -> response(s)

_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def behavior_of(handler: grpc.RpcMethodHandler) -> Behavior:
    """The function that serves the method, whichever its shape."""
    name, _ = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return getattr(handler, name)


def rewrap(
    handler: grpc.RpcMethodHandler,
    behavior: Behavior,
    *,
    raw_requests: bool = False,
    serialized_responses: bool = False,
) -> grpc.RpcMethodHandler:
    """A handler of the same shape and serializers serving `behavior`; with `raw_requests`
    the behavior gets the request bytes undecoded; with `serialized_responses` it may answer
    bytes it serialized itself (off the event loop), which are sent as they are."""
    _, make = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
    serialize = handler.response_serializer
    if serialized_responses and serialize is not None:
        serialize = _bytes_as_they_are(serialize)
    return make(
        behavior,
        request_deserializer=None if raw_requests else handler.request_deserializer,
        response_serializer=serialize,
    )


def _bytes_as_they_are(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    def serialize_unless_bytes(response: Any) -> bytes:
        return response if isinstance(response, bytes) else serialize(response)

    return serialize_unless_bytes


async def write_all(responses: Any, context: grpc.aio.ServicerContext) -> None:
    """Sends a streaming behavior's responses with `context.write`, inside the RPC's own task.

    grpc.aio leaves an async generator suspended at its `yield` when the client cancels
    during a send; the event loop then closes it later from another task, where context
    variables set by the generator (OpenTelemetry's current span) cannot be reset. Closing it
    here keeps its cleanup in the task, and the context, it started in.
    """
    if inspect.isawaitable(responses):  # the reader/writer style already writes itself
        await responses
        return
    try:
        async for response in responses:
            await context.write(response)
    finally:
        await responses.aclose()
