"""`/v1/responses`, OpenAI's Responses API: `POST` creates a response (JSON, or server-sent
events with `stream`), `GET /v1/responses/{id}` returns a stored one, `DELETE` forgets it.

A request becomes one chat generation: its input items (after the stored conversation that
`previous_response_id` names, with this request's `instructions` first) rendered through the
chat template (router/http/response_prompt.py), and its options as the chat completion's
(`max_output_tokens`, `temperature`, `top_p`, `text.format` as `response_format`, so the
grammar path is the same; function `tools`, `tool_choice` and `parallel_tool_calls` as chat's,
router/http/response_tools.py, so a forced call is constrained and read as on chat). Then it
runs as every OpenAI request does (router/http/service.py), and with `store` (the default) its
conversation is kept in Redis (router/http/response_store.py) for the next turn, whose prompt
starts with this turn's tokens: the prefix index routes it to the worker holding their KV.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from router.http.chat_template import ChatTemplateError
from router.http.choices import Choice
from router.http.disconnects import ClientGone, until_disconnect
from router.http.errors import UnknownModel, error_body, error_response, status_and_body
from router.http.request_body import INLINE_BYTES, decode
from router.http.response_events import EventStream, ResponseShape, final_status
from router.http.response_prompt import continuation, input_messages, with_instructions
from router.http.response_schemas import ResponsesRequest
from router.http.response_store import (
    ResponseNotFound,
    ResponseStore,
    StoredResponse,
    StoreUnavailable,
)
from router.http.response_tools import (
    ResponseTools,
    chat_tool_choice,
    chat_tools,
    responses_names,
)
from router.http.schemas import ChatCompletionRequest, ChatMessage
from router.http.service import OpenAIService
from router.http.tool_messages import with_tool_calls_for_template
from router.http.tool_request import check_tools, forces_calls, template_tools
from router.http.translate import generate_request, openai_names
from router.request_run import Step
from router.validation import RequestError, ValidRequest, validate

log = logging.getLogger(__name__)
_TRACE_HEADERS = ("traceparent", "tracestate")
STATUSES = {
    200: "the response (JSON, or server-sent events with `stream`)",
    400: "a malformed or invalid body, or an unknown previous_response_id: the message names "
    "the field",
    401: "missing or invalid API key",
    404: "the body names a model this server does not serve",
    429: "overloaded: admission control or a full CPU pool; retry later",
    503: "no worker can take it now, or the response store (Redis) does not answer",
}
_WORKER_GRAMMAR = "sampling.grammar: "
# Options pdserve does not implement, refused unless unset (or the neutral value given).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "conversation": (None,),
    "prompt": (None,),
    "reasoning": (None,),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "include": (None, []),
}


def add_response_routes(
    app: FastAPI, service: OpenAIService, store: ResponseStore, authorized: Callable
) -> None:
    body_schema = ResponsesRequest.model_json_schema()
    documented = {
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": body_schema}},
            }
        },
        "responses": {status: {"description": text} for status, text in STATUSES.items()},
    }

    # The body is read after the API key is checked, as on the other generation routes.
    @app.post("/v1/responses", dependencies=[Depends(authorized)], **documented)
    async def create(request: Request) -> Response:
        try:
            raw = await request.body()
            if len(raw) <= INLINE_BYTES:
                body = decode(raw, ResponsesRequest)
            else:
                body = await service.cpu.run(decode, raw, ResponsesRequest)
            return await _create(service, store, body, request)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:
            return _error(exc, request)

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def retrieve(response_id: str, request: Request) -> Response:
        try:
            return JSONResponse((await store.get(response_id)).response)
        except Exception as exc:
            return _error(exc, request)

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def delete(response_id: str, request: Request) -> Response:
        try:
            await store.delete(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        except Exception as exc:
            return _error(exc, request)


def _error(exc: Exception, request: Request) -> Response:
    if isinstance(exc, ResponseNotFound):
        message = f"response_id: no stored response {exc.args[0]!r} (never stored, or expired)"
        return JSONResponse(error_body(404, message, "response_not_found"), status_code=404)
    if isinstance(exc, StoreUnavailable):
        return JSONResponse(error_body(503, str(exc)), status_code=503)
    if isinstance(exc, RequestError) and str(exc).startswith(_WORKER_GRAMMAR):
        # A grammar the worker could not compile (router/request_flow.py), as the body names it:
        # forced calls' (_create notes it) or text.format's.
        field = getattr(request.state, "grammar_field", "text.format")
        exc = RequestError(f"{field}: " + str(exc).removeprefix(_WORKER_GRAMMAR))
    response = error_response(exc)
    level = logging.WARNING if response.status_code >= 500 else logging.DEBUG
    log.log(level, "%s failed: %s", request.url.path, exc)
    return response


async def _create(
    service: OpenAIService, store: ResponseStore, body: ResponsesRequest, request: Request
) -> Response:
    chat = _check_supported(body, service)
    if forces_calls(chat):
        request.state.grammar_field = "tools"
    previous = await _previous(store, body.previous_response_id)
    earlier = previous.conversation if previous else []
    conversation = earlier + input_messages(body, earlier)
    if not conversation:
        raise RequestError("input: required (a string or a list of messages)")
    record = await _prompt(service, body, chat, conversation, previous)
    size = store.size(record) if body.store else 0
    if size > store.max_bytes:
        raise RequestError(
            f"input: the conversation would be stored as {size} bytes, over the "
            f"bound of {store.max_bytes} bytes a stored response may hold "
            "(--response-max-bytes); start a new conversation or send it with store=false"
        )
    valid = await _validate(service, chat, record.prompt_ids)
    choice = service.choices([valid])[0]
    tool_output = service.tool_output(chat)
    shape = ResponseShape(
        id="resp_" + valid.work_id,
        message_id="msg_" + valid.work_id,
        model=service.limits.name,
        body=body,
        text_format=_text_format(body),
        tools=None if tool_output is None else ResponseTools(tool_output),
    )
    metadata = {k: request.headers[k] for k in _TRACE_HEADERS if k in request.headers}
    try:
        if not body.stream:
            await until_disconnect(request, service.collect([valid], [choice], metadata))
            response = shape.response(final_status(choice), choice)
            await _keep(store, body, record, shape, choice, response)
            return JSONResponse(response)
        steps = service.stream([valid], [choice], metadata)
        try:
            # A request refused before its first token gets its HTTP error, as on chat.
            first = await until_disconnect(request, anext(steps))
        except BaseException:
            await steps.aclose()
            raise
    except ClientGone:
        return Response(status_code=499)
    events = _events(EventStream(shape), store, body, record, choice, first, steps)
    return StreamingResponse(events, media_type="text/event-stream")


async def _events(
    stream: EventStream,
    store: ResponseStore,
    body: ResponsesRequest,
    record: StoredResponse,
    choice: Choice,
    first: tuple[Choice, Step],
    steps: AsyncIterator[tuple[Choice, Step]],
) -> AsyncIterator[bytes]:
    """The stream's events; the response is stored before the last one, so a client that
    continues it at once finds it."""
    async with aclosing(steps):
        try:
            yield stream.opening()
            yield stream.step(choice, first[1].batch, True)
            async for _, step in steps:
                yield stream.step(choice, step.batch, False)
            status = final_status(choice)
            response = stream.shape.response(status, choice)
            await _keep(store, body, record, stream.shape, choice, response)
            yield stream.closing(choice)
        except Exception as exc:
            yield stream.failed(status_and_body(exc)[1]["error"])


async def _previous(store: ResponseStore, response_id: str | None) -> StoredResponse | None:
    if response_id is None:
        return None
    try:
        return await store.get(response_id)
    except ResponseNotFound:
        raise RequestError(
            f"previous_response_id: no stored response {response_id!r} (never stored, stored "
            "with store=false, deleted, or expired)"
        ) from None


async def _prompt(
    service: OpenAIService,
    body: ResponsesRequest,
    chat: ChatCompletionRequest,
    conversation: list[dict[str, Any]],
    previous: StoredResponse | None,
) -> StoredResponse:
    """The record this turn will store: its conversation so far and its prompt, as text and
    as token ids that start with the previous turn's when the text allows it."""
    template = service.chat_template
    if template is None:
        raise RequestError(
            "input: this model has no chat template (no chat_template in its "
            "tokenizer_config.json); send a prompt to /v1/completions instead"
        )
    messages = with_tool_calls_for_template(with_instructions(body.instructions, conversation))
    tools = template_tools(chat)
    if tools and "tools" not in template.source:
        raise RequestError("tools: this model's chat template does not render tools")
    try:
        rendered = await service.cpu.run(template.render, messages, True, tools)
    except ChatTemplateError as e:
        raise RequestError(f"input: the model's chat template refused it: {e}") from None
    tokenizer = service.tokenizer
    follows = None
    if previous is not None:
        follows = await tokenizer.run(continuation, rendered, previous, tokenizer.tokenizer)
    if follows is None:
        ids = await tokenizer.encode(rendered, add_special_tokens=False)
    else:
        ids = follows.prefix_ids + await tokenizer.encode(follows.rest, add_special_tokens=False)
    return StoredResponse(
        response={}, conversation=conversation, prompt_text=rendered, prompt_ids=ids
    )


def _chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The request's sampling and tools as a chat completion's (its prompt is made apart)."""
    return ChatCompletionRequest(
        messages=[ChatMessage(role="user", content="")],
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        response_format=_response_format(body),
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
    )


async def _validate(
    service: OpenAIService, chat: ChatCompletionRequest, ids: list[int]
) -> ValidRequest:
    """The request checked as every request is."""
    try:
        return await validate(generate_request(chat, ids), service.limits, service.tokenizer.encode)
    except RequestError as e:
        # Chat's names, which generate_request uses, as this body spells them.
        message = str(e).replace("response_format", "text.format", 1)
        message = responses_names(message.replace("max_completion_tokens", "max_output_tokens"))
        raise openai_names(
            RequestError(message), "input", "max_output_tokens", "text.format"
        ) from None


def _check_supported(body: ResponsesRequest, service: OpenAIService) -> ChatCompletionRequest:
    """The request as a chat completion's, once what it asks is known to be supported."""
    if body.model is not None and body.model != service.limits.name:
        raise UnknownModel(
            f"model: the model {body.model!r} does not exist; this server serves "
            f"{service.limits.name!r}"
        )
    for name, neutral in _NEUTRAL.items():
        if getattr(body, name) not in neutral:
            raise RequestError(f"{name}: not supported; leave it unset")
    chat = _chat_request(body)
    try:
        check_tools(chat)
    except RequestError as e:
        raise RequestError(responses_names(str(e))) from None
    return chat


def _text_format(body: ResponsesRequest) -> dict[str, Any]:
    return (body.text.format if body.text else None) or {"type": "text"}


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (Responses flattens json_schema's fields)."""
    text_format = _text_format(body)
    kind = text_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise RequestError(
            f"text.format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}"
        )
    if not isinstance(text_format.get("schema"), dict):
        raise RequestError("text.format.schema: a JSON schema object is required")
    fields = {k: text_format[k] for k in ("name", "schema", "strict") if k in text_format}
    return {"type": "json_schema", "json_schema": fields}


async def _keep(
    store: ResponseStore,
    body: ResponsesRequest,
    record: StoredResponse,
    shape: ResponseShape,
    choice: Choice,
    response: dict[str, Any],
) -> None:
    """Stores the finished turn, with `store`: its output (words, or function calls as
    tool_calls) ends the conversation."""
    if not body.store:
        return
    record.response = response
    output = {"role": "assistant", "content": choice.text}
    if shape.tools is not None:
        output = shape.tools.assistant_message(choice.text)
    record.conversation = [*record.conversation, output]
    record.output_ids = list(choice.token_ids)
    await store.put(record)
