"""The OpenAI-compatible HTTP API: FastAPI routes over OpenAIService.

`/v1/completions`, `/v1/chat/completions` (JSON or server-sent events), `/v1/models`,
`/v1/responses` (router/http/responses.py) when given the response store; and for
probes and scrapers `/health` (the process is up), `/ready` (a decode worker can take requests)
and `/metrics` (the router's Prometheus registry, as on the metrics port). With API keys
configured the `/v1` routes need `Authorization: Bearer <key>` (the gRPC API's keys); the
probes and `/metrics` stay open, as gRPC health does. The key is checked before the body is
read, and bodies are read and decoded as router/http/request_body.py says. A client that
disconnects cancels its request, which aborts it on its workers. `app.openapi()` documents each
generation route's body schema and every status it answers (the HTTP fuzz suite holds the
server to it); the document is not served.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import prometheus_client
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from router.auth import ApiKeyInterceptor
from router.http.body_limit import BodyLimit
from router.http.choices import Choice, ResponseShape, to_json, usage
from router.http.disconnects import ClientGone, until_disconnect
from router.http.errors import error_body, error_response, status_and_body
from router.http.request_body import INLINE_BYTES, decode, max_body_bytes, validation_message
from router.http.response_store import ResponseStore
from router.http.responses import add_response_routes
from router.http.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from router.http.service import OpenAIService
from router.http.translate import wants_logprobs
from router.request_run import Step

log = logging.getLogger(__name__)
_TRACE_HEADERS = ("traceparent", "tracestate")
_REFUSAL = "missing or invalid API key (header 'Authorization: Bearer <key>')"
# Every status a generation route answers (router/http/errors.py, body_limit.py, connections.py).
GENERATION_STATUSES = {
    200: "the completion (JSON, or server-sent events with `stream`)",
    400: "a malformed or invalid body: the message names the field",
    401: "missing or invalid API key",
    404: "the body names a model this server does not serve",
    405: "a method other than POST",
    408: "the request's headers and body took too long to arrive (connection closed)",
    413: "the body is larger than any valid request (connection closed)",
    429: "overloaded: admission control or a full CPU pool; retry later",
    503: "no worker can take it now, or too many connections are open",
}
# Refusals after which the connection is closed: the client may still be sending a body
# nobody will read.
_CLOSING = {401, 413}


def create_app(
    service: OpenAIService,
    auth: ApiKeyInterceptor,
    ready: Callable[[], bool] = lambda: True,
    unready_reason: Callable[[], str] = lambda: "no decode worker is up",
    response_store: ResponseStore | None = None,
) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes(service.limits))
    started = int(time.time())

    async def authorized(request: Request) -> None:
        header = request.headers.get("authorization")
        if auth.api_keys and not auth.authorized([("authorization", header or "")]):
            raise HTTPException(401, _REFUSAL)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, validation_message(exc)), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        headers = {"connection": "close"} if exc.status_code in _CLOSING else None
        body = error_body(exc.status_code, str(exc.detail))
        return JSONResponse(body, exc.status_code, headers=headers)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def readiness() -> JSONResponse:
        if ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse(error_body(503, unready_reason()), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            prometheus_client.generate_latest(),
            media_type=prometheus_client.CONTENT_TYPE_LATEST,
        )

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(service, started)]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorized)])
    async def model(model: str) -> Any:
        if model != service.limits.name:
            return JSONResponse(
                error_body(404, f"model: the model {model!r} does not exist", "model_not_found"),
                status_code=404,
            )
        return _model_card(service, started)

    # The body is not a parameter: FastAPI would read and decode it on the loop, before the
    # API key is checked. `_generate` reads it after (the dependency runs first).
    @app.post(
        "/v1/completions", dependencies=[Depends(authorized)], **_documented(CompletionRequest)
    )
    async def completions(request: Request) -> Response:
        return await _generate(service, CompletionRequest, request, chat=False)

    @app.post(
        "/v1/chat/completions",
        dependencies=[Depends(authorized)],
        **_documented(ChatCompletionRequest),
    )
    async def chat_completions(request: Request) -> Response:
        return await _generate(service, ChatCompletionRequest, request, chat=True)

    if response_store is not None:  # `/v1/responses` keeps its state in the index's Redis
        add_response_routes(app, service, response_store, authorized)
    return app


async def _generate(
    service: OpenAIService, model: type[SamplingFields], request: Request, chat: bool
) -> Response:
    try:
        body = await _body(service, request, model)
        return await _respond(service, body, request, chat)
    except ClientDisconnect:  # left (or was cut off by a deadline) before its body arrived
        return Response(status_code=499)
    except Exception as exc:
        response = error_response(exc)
        level = logging.WARNING if response.status_code >= 500 else logging.DEBUG
        log.log(level, "%s failed: %s", request.url.path, exc)
        return response


async def _body(
    service: OpenAIService, request: Request, model: type[SamplingFields]
) -> SamplingFields:
    """The request's body as `model`, decoded on the service's pool unless it is small."""
    raw = await request.body()  # under the BodyLimit middleware's cap
    if len(raw) <= INLINE_BYTES:
        return decode(raw, model)
    return await service.cpu.run(decode, raw, model)


async def _respond(
    service: OpenAIService, body: SamplingFields, request: Request, chat: bool
) -> Response:
    valid = await service.prepare(body)
    choices = service.choices(valid)
    metadata = {k: request.headers[k] for k in _TRACE_HEADERS if k in request.headers}
    shape = ResponseShape(
        id=("chatcmpl-" if chat else "cmpl-") + valid[0].work_id,
        model=service.limits.name,
        chat=chat,
        tokenizer=service.tokenizer.tokenizer,
        logprobs=wants_logprobs(body),
        return_token_ids=body.return_token_ids,
        tools=service.tool_output(body),
    )
    try:
        if not body.stream:
            await until_disconnect(request, service.collect(valid, choices, metadata))
            return JSONResponse(shape.response(choices))
        per_token = bool(body.stream_options and body.stream_options.one_token_per_event)
        steps = service.stream(valid, choices, metadata, per_token)
        try:
            # The first step decides the status: a request refused before its first token
            # (overloaded, no worker) gets its HTTP error, not a 200 with an error event.
            first = await until_disconnect(request, anext(steps))
        except BaseException:
            await steps.aclose()
            raise
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the request was aborted
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    # vLLM's extension (guidellm asks for it): every chunk also carries the usage so far.
    continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
    events = _events(shape, choices, first, steps, include_usage, continuous_usage)
    return StreamingResponse(events, media_type="text/event-stream")


async def _events(
    shape: ResponseShape,
    choices: list[Choice],
    first: tuple[Choice, Step],
    steps: AsyncIterator[tuple[Choice, Step]],
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per step (with the usage so far if `continuous_usage`),
    the usage if asked, then `[DONE]`. An error after the first chunk is an error event.
    Cancelled (the client left), it closes `steps`, which aborts the requests."""
    started: set[int] = set()

    def event(choice: Choice, step: Step) -> bytes:
        so_far = usage(choices) if continuous_usage else None
        first_of_choice = choice.index not in started
        chunk = shape.chunk(choice, step.batch, first_of_choice, usage_so_far=so_far)
        started.add(choice.index)
        return _sse(chunk)

    async with aclosing(steps):
        try:
            yield event(*first)
            async for choice, step in steps:
                yield event(choice, step)
            if include_usage:
                yield _sse(shape.usage_chunk(choices))
        except Exception as exc:
            yield _sse(to_json(status_and_body(exc)[1]))
    yield b"data: [DONE]\n\n"


def _sse(data_json: str) -> bytes:
    """One server-sent event carrying `data_json`."""
    return f"data: {data_json}\n\n".encode()


def _documented(model: type[SamplingFields]) -> dict:
    """The OpenAPI of a route that reads its body itself: the body's schema (refs local to it)
    and the statuses it answers."""
    body = {"content": {"application/json": {"schema": model.model_json_schema()}}}
    return {
        "openapi_extra": {"requestBody": {"required": True, **body}},
        "responses": {
            status: {"description": text} for status, text in GENERATION_STATUSES.items()
        },
    }


def _model_card(service: OpenAIService, created: int) -> dict:
    return {
        "id": service.limits.name,
        "object": "model",
        "created": created,
        "owned_by": "pdserve",
        "max_model_len": service.limits.max_model_len,
    }
