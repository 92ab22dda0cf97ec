"""Request bytes that do not parse are the client's error: INVALID_ARGUMENT, and no log noise.

grpc.aio decodes a request before the servicer runs and answers a failure with UNKNOWN and an
ERROR traceback per request; this interceptor decodes unary requests itself instead. It also
lets a method answer bytes it serialized itself: grpc.aio serializes responses on the event
loop, and a Tokenize response of a million token strings takes 0.1 s to serialize
(router/generation_service.py does it on the tokenizer threads).
"""

from __future__ import annotations

import inspect
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from pdserve.grpc_handlers import behavior_of, rewrap, write_all


class RequestDecodingInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        decode, serve = handler.request_deserializer, behavior_of(handler)

        async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            response = serve(await _decoded(decode, raw, context), context)
            return await response if inspect.isawaitable(response) else response

        async def streaming(raw: bytes, context: grpc.aio.ServicerContext) -> None:
            await write_all(serve(await _decoded(decode, raw, context), context), context)

        return rewrap(
            handler,
            streaming if handler.response_streaming else unary,
            raw_requests=True,
            serialized_responses=True,
        )


async def _decoded(decode: Any, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
    try:
        return decode(raw)
    except DecodeError:
        message_type = getattr(getattr(decode, "__self__", None), "DESCRIPTOR", None)
        name = message_type.full_name if message_type else "request message"
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request: not a valid {name} (malformed protobuf, or a string field that is not "
            "valid UTF-8)",
        )
