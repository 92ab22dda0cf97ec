"""A Responses request's prompt: its input items as chat messages, after the stored
conversation it continues, rendered through the chat template; and, for a continuation, the
previous turn's tokens kept as they were computed.

The worker that ran the previous turn holds the KV of its prompt and output tokens, and the
prefix index routes by token blocks: the continuation finds that KV only if its prompt starts
with exactly those tokens. Tokenizing the whole re-rendered conversation would not always give
them back (the model's output tokens need not be how the tokenizer splits their text, and
merges can cross the boundary). So when the rendered conversation starts with the previous
turn's prompt text followed by its output text (and the stop token the template writes after
it), the prompt is the previous prompt's tokens + the output's tokens + the tokens of the rest;
when it does not (a template that rewrites earlier turns, different instructions), the whole
text is tokenized and only the prefix that still matches is found cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.tokenizer import Tokenizer
from router.http.response_schemas import ResponsesRequest
from router.http.response_store import StoredResponse
from router.http.schemas import MAX_MESSAGES
from router.validation import RequestError

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class Continuation:
    """The previous turn's tokens the prompt starts with, and the text after them."""

    prefix_ids: list[int]
    rest: str


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages; RequestError naming the item that is not a text
    message."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise RequestError("input: empty list; give a string or at least one message")
    if len(body.input) > MAX_MESSAGES:
        raise RequestError(f"input: {len(body.input)} items; at most {MAX_MESSAGES}")
    messages = []
    for i, item in enumerate(body.input):
        if item.type != "message" or item.role is None:
            raise RequestError(
                f"input[{i}].type: only messages are supported (role and content), got "
                f"{item.type!r}"
            )
        role = _ROLES.get(item.role)
        if role is None:
            raise RequestError(
                f"input[{i}].role: must be 'user', 'assistant', 'system' or 'developer', "
                f"got {item.role!r}"
            )
        messages.append({"role": role, "content": _content(item.content, i)})
    return messages


def _content(content: Any, i: int) -> str | list[dict[str, str]]:
    if content is None:
        raise RequestError(f"input[{i}].content: required")
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise RequestError(
                f"input[{i}].content[{j}]: only text parts are supported, got type {part.type!r}"
            )
        parts.append({"type": "text", "text": part.text})
    return parts


def with_instructions(instructions: str | None, conversation: list[dict]) -> list[dict]:
    """The messages the template renders: the instructions as the first, a system message."""
    if not instructions:
        return conversation
    return [{"role": "system", "content": instructions}, *conversation]


def continuation(
    rendered: str, previous: StoredResponse, tokenizer: Tokenizer
) -> Continuation | None:
    """How `rendered` continues the previous turn token for token; None when it does not start
    with the previous turn's prompt and output text."""
    output = previous.conversation[-1]["content"]
    before = previous.prompt_text + output
    if not rendered.startswith(before):
        return None
    ids = list(previous.output_ids)
    stop = ids.pop() if ids and ids[-1] in tokenizer.eos_token_ids else None
    if tokenizer.decode(ids, skip_special_tokens=False) != output:
        return None  # the output's tokens do not spell its text (special tokens, cut bytes)
    rest = rendered[len(before) :]
    prefix = previous.prompt_ids + ids
    if stop is not None:
        stop_text = tokenizer.decode([stop], skip_special_tokens=False)
        if rest.startswith(stop_text):  # the template ends the turn with the model's stop token
            prefix.append(stop)
            rest = rest[len(stop_text) :]
    return Continuation(prefix, rest)
