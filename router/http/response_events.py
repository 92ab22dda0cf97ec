"""The JSON of `/v1/responses` answers: the Response object, and the server-sent events of a
stream in the order the OpenAI SDK parses them, each with its `sequence_number`:

response.created, response.in_progress, then each output item in turn: the message's
response.output_item.added, response.content_part.added, response.output_text.delta (one per
step), response.output_text.done, response.content_part.done, response.output_item.done; a
function call's response.output_item.added, response.function_call_arguments.delta (as its
arguments grow), response.function_call_arguments.done, response.output_item.done; then
response.completed (or response.incomplete when max_output_tokens cut the output);
response.failed if generation fails after the stream began.

Without tools the output is one message, added before the first token. With tools it is the
message (only when the model wrote words, which come before any call) and a `function_call`
item per call, as router/http/tool_output.py reads them from the text so far: a call's item is
added once its name is known, and each item is done once the next begins or the output ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.core.messages import TokenBatch
from router.http.choices import Choice, to_json, usage
from router.http.response_schemas import ResponsesRequest
from router.http.response_tools import ResponseTools, function_call_item
from router.http.tool_parsers import ToolCall


@dataclass
class ResponseShape:
    """What the Response object of one request holds besides its output."""

    id: str  # "resp_..."
    message_id: str  # "msg_...": its output message
    model: str
    body: ResponsesRequest
    text_format: dict[str, Any]
    tools: ResponseTools | None = None  # the output read for function calls
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self, status: str, choice: Choice | None = None, error: dict | None = None
    ) -> dict[str, Any]:
        """The Response object: in progress (no output yet), or with `choice`'s output."""
        body = self.body
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": [],
            "parallel_tool_calls": True
            if body.parallel_tool_calls is None
            else body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": self.text_format},
            "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
            "tools": body.tools or [],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }
        if choice is not None and status != "in_progress":
            out["output"] = self.output(choice, status)
            out["usage"] = response_usage(choice)
            if choice.finish_reason == "length":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def output(self, choice: Choice, status: str) -> list[dict[str, Any]]:
        text, calls = self.parts(choice)
        # Words before calls are a finished message whatever cut the output later.
        items = [] if text is None else [self.message(text, "completed" if calls else status)]
        if self.tools is not None:
            items += [self.tools.item(k, call, status) for k, call in enumerate(calls)]
        return items

    def parts(self, choice: Choice) -> tuple[str | None, list[ToolCall]]:
        """The message's text (None: no message, the output is only calls) and the calls."""
        if self.tools is None:
            return choice.text, []
        content, calls = self.tools.split(choice.text)
        if not calls:
            return choice.text, []
        return (content if content.strip() else None), calls

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        """The output message item; its content is empty while in progress (`text` None)."""
        content = [] if text is None else [self.text_part(text)]
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    @staticmethod
    def text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def final_status(choice: Choice) -> str:
    """OpenAI's statuses: cut by max_output_tokens (or the context) is "incomplete"."""
    return "incomplete" if choice.finish_reason == "length" else "completed"


def response_usage(choice: Choice) -> dict[str, Any]:
    counts = usage([choice])
    return {
        "input_tokens": counts["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": counts["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": counts["total_tokens"],
    }


class EventStream:
    """Numbers the events of one stream and writes each as a server-sent event."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self._sequence = 0
        self._items = 0  # output items added
        self._message_at: int | None = None  # the message's output index, once added
        self._message_done = False
        self._text = ""  # of the message, sent
        self._calls_at: list[int] = []  # each call's output index
        self._call_items: list[str] = []  # ...and item id
        self._arguments: list[str] = []  # each call's arguments, sent

    def opening(self) -> bytes:
        """Everything before the first token: the response created and in progress, and
        without tools its message item and text part added."""
        in_progress = self.shape.response("in_progress")
        events = [
            self._event("response.created", response=in_progress),
            self._event("response.in_progress", response=in_progress),
        ]
        if self.shape.tools is None:
            events.append(self._open_message())
        return b"".join(events)

    def step(self, choice: Choice, batch: TokenBatch, first: bool) -> bytes:
        """The events of `batch`, which `choice` has taken."""
        tools = self.shape.tools
        if tools is None:
            return self._text_delta(batch.text) if batch.text else b""
        delta, _ = tools.output.delta(0, choice.text, batch, first)
        events = [self._text_delta(delta["content"])] if delta.get("content") else []
        for call in delta.get("tool_calls", []):
            k, function = call["index"], call["function"]
            if "id" in call:
                events.append(self._add_call(ToolCall(call["id"], function["name"], "")))
            events.append(self._arguments_delta(k, function["arguments"]))
        return b"".join(events)

    def closing(self, choice: Choice) -> bytes:
        """Everything after the last token: each item done, the response finished."""
        shape, status = self.shape, final_status(choice)
        text, calls = shape.parts(choice)
        events = []
        if text is not None:
            if self._message_at is None:
                events.append(self._open_message())
            if text.startswith(self._text) and len(text) > len(self._text):
                events.append(self._text_delta(text[len(self._text) :]))
            events.append(self._close_message(text, status))
        for k, call in enumerate(calls):
            if k == len(self._calls_at):
                events.append(self._add_call(call))
            if call.arguments.startswith(self._arguments[k]):
                events.append(self._arguments_delta(k, call.arguments[len(self._arguments[k]) :]))
            ids = {"item_id": self._call_items[k], "output_index": self._calls_at[k]}
            events += [
                self._event(
                    "response.function_call_arguments.done",
                    **ids,
                    name=call.name,
                    arguments=call.arguments,
                ),
                self._event(
                    "response.output_item.done",
                    output_index=self._calls_at[k],
                    item=function_call_item(self._call_items[k], call, status),
                ),
            ]
        events.append(self._event(f"response.{status}", response=shape.response(status, choice)))
        return b"".join(events)

    def failed(self, error: dict[str, Any]) -> bytes:
        """The stream's end when generation failed after it began: `error` is the OpenAI error
        body's inner object."""
        overloaded = error.get("type") == "rate_limit_error"
        code = "rate_limit_exceeded" if overloaded else "server_error"  # OpenAI's codes
        failure = {"code": code, "message": error["message"]}
        return self._event("response.failed", response=self.shape.response("failed", error=failure))

    def _open_message(self) -> bytes:
        self._message_at = self._items
        self._items += 1
        ids = {"item_id": self.shape.message_id, "output_index": self._message_at}
        return self._event(
            "response.output_item.added",
            output_index=self._message_at,
            item=self.shape.message(None, "in_progress"),
        ) + self._event(
            "response.content_part.added", **ids, content_index=0, part=self.shape.text_part("")
        )

    def _text_delta(self, text: str) -> bytes:
        opened = b"" if self._message_at is not None else self._open_message()
        self._text += text
        return opened + self._event(
            "response.output_text.delta",
            item_id=self.shape.message_id,
            output_index=self._message_at,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _close_message(self, text: str, status: str) -> bytes:
        """The message's text, part and item done (once: before the first call, or at the end)."""
        if self._message_done:
            return b""
        self._message_done = True
        shape = self.shape
        ids = {"item_id": shape.message_id, "output_index": self._message_at, "content_index": 0}
        return b"".join(
            [
                self._event("response.output_text.done", **ids, text=text, logprobs=[]),
                self._event("response.content_part.done", **ids, part=shape.text_part(text)),
                self._event(
                    "response.output_item.done",
                    output_index=self._message_at,
                    item=shape.message(text, status),
                ),
            ]
        )

    def _add_call(self, call: ToolCall) -> bytes:
        """A call's item added (its arguments follow as deltas); the message before it done."""
        tools = self.shape.tools
        assert tools is not None
        k = len(self._calls_at)
        tools.stable(k, call)
        done = b""
        if self._message_at is not None:
            done = self._close_message(self._text, "completed")
        self._calls_at.append(self._items)
        self._call_items.append(tools.item_ids[k])
        self._arguments.append("")
        self._items += 1
        item = tools.item(k, ToolCall(tools.call_ids[k], call.name, ""), "in_progress")
        return done + self._event(
            "response.output_item.added", output_index=self._calls_at[k], item=item
        )

    def _arguments_delta(self, k: int, more: str) -> bytes:
        if not more:
            return b""
        self._arguments[k] += more
        return self._event(
            "response.function_call_arguments.delta",
            item_id=self._call_items[k],
            output_index=self._calls_at[k],
            delta=more,
        )

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = to_json({"type": kind, **fields, "sequence_number": self._sequence})
        self._sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()
