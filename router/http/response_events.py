"""The JSON of `/v1/responses` answers: the Response object, and the server-sent events of a
stream in the order the OpenAI SDK parses them, each with its `sequence_number`:

response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (one per step), response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed (or
response.incomplete when max_output_tokens cut the output); response.failed if generation fails
after the stream began.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from router.http.choices import Choice, to_json, usage
from router.http.response_schemas import ResponsesRequest


@dataclass
class ResponseShape:
    """What the Response object of one request holds besides its output."""

    id: str  # "resp_..."
    message_id: str  # "msg_...": its one output message
    model: str
    body: ResponsesRequest
    text_format: dict[str, Any]
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
            "tools": [],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }
        if choice is not None and status != "in_progress":
            out["output"] = [self.message(choice, status)]
            out["usage"] = response_usage(choice)
            if choice.finish_reason == "length":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def message(self, choice: Choice | None, status: str) -> dict[str, Any]:
        """The output message item; its content is empty while in progress."""
        content = [] if choice is None else [self.text_part(choice.text)]
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

    def opening(self) -> bytes:
        """Everything before the first token: the response created and in progress, its
        message item and text part added."""
        shape, ids = self.shape, {"item_id": self.shape.message_id, "output_index": 0}
        in_progress = shape.response("in_progress")
        return b"".join(
            [
                self._event("response.created", response=in_progress),
                self._event("response.in_progress", response=in_progress),
                self._event(
                    "response.output_item.added",
                    output_index=0,
                    item=shape.message(None, "in_progress"),
                ),
                self._event(
                    "response.content_part.added",
                    **ids,
                    content_index=0,
                    part=shape.text_part(""),
                ),
            ]
        )

    def delta(self, text: str) -> bytes:
        return self._event(
            "response.output_text.delta",
            item_id=self.shape.message_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def closing(self, choice: Choice) -> bytes:
        """Everything after the last token: text, part and item done, the response finished."""
        shape, status = self.shape, final_status(choice)
        ids = {"item_id": shape.message_id, "output_index": 0, "content_index": 0}
        return b"".join(
            [
                self._event("response.output_text.done", **ids, text=choice.text, logprobs=[]),
                self._event("response.content_part.done", **ids, part=shape.text_part(choice.text)),
                self._event(
                    "response.output_item.done", output_index=0, item=shape.message(choice, status)
                ),
                self._event(f"response.{status}", response=shape.response(status, choice)),
            ]
        )

    def failed(self, error: dict[str, Any]) -> bytes:
        """The stream's end when generation failed after it began: `error` is the OpenAI error
        body's inner object."""
        overloaded = error.get("type") == "rate_limit_error"
        code = "rate_limit_exceeded" if overloaded else "server_error"  # OpenAI's codes
        failure = {"code": code, "message": error["message"]}
        return self._event("response.failed", response=self.shape.response("failed", error=failure))

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = to_json({"type": kind, **fields, "sequence_number": self._sequence})
        self._sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()
