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
after function calls (which the template writes in its own syntax, not as the model's tokens),
the previous prompt's tokens + the tokens of the rest; when the text does not start so (a
template that rewrites earlier turns, different instructions), the whole text is tokenized and
only the prefix that still matches is found cached.

Input items are messages, `function_call`s (an assistant message's tool_calls, several in a row
making one message) and `function_call_output`s (a tool message, answering a call made earlier
in the input or in the stored conversation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.tokenizer import Tokenizer
from router.http.response_schemas import InputItem, ResponsesRequest
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


def input_messages(body: ResponsesRequest, earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as chat messages (after the `earlier` conversation, whose calls its
    function_call_output items may answer); RequestError naming the item that is neither a
    message, a function call nor a call's output."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise RequestError("input: empty list; give a string or at least one message")
    if len(body.input) > MAX_MESSAGES:
        raise RequestError(f"input: {len(body.input)} items; at most {MAX_MESSAGES}")
    call_ids = {c["id"] for m in earlier for c in m.get("tool_calls", ())}
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        if item.type == "function_call":
            call = _function_call(item, i)
            call_ids.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if item.type == "function_call_output":
            messages.append(_call_output(item, i, call_ids))
            continue
        if item.type != "message" or item.role is None:
            raise RequestError(
                f"input[{i}].type: must be 'message', 'function_call' or "
                f"'function_call_output', got {item.type!r}"
            )
        role = _ROLES.get(item.role)
        if role is None:
            raise RequestError(
                f"input[{i}].role: must be 'user', 'assistant', 'system' or 'developer', "
                f"got {item.role!r}"
            )
        messages.append({"role": role, "content": _content(item.content, i)})
    return messages


def _function_call(item: InputItem, i: int) -> dict[str, Any]:
    """A function_call item as chat's tool call (its arguments stay JSON text)."""
    fields = item.model_extra or {}
    for name in ("call_id", "name", "arguments"):
        if not isinstance(fields.get(name), str):
            raise RequestError(f"input[{i}].{name}: a string is required in a function_call")
    try:
        arguments = json.loads(fields["arguments"])
    except ValueError as e:
        raise RequestError(f"input[{i}].arguments: not valid JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise RequestError(f"input[{i}].arguments: must be a JSON object")
    function = {"name": fields["name"], "arguments": fields["arguments"]}
    return {"id": fields["call_id"], "type": "function", "function": function}


def _call_output(item: InputItem, i: int, call_ids: set[str]) -> dict[str, Any]:
    """A function_call_output item as chat's tool message; it must answer an earlier call."""
    fields = item.model_extra or {}
    call_id = fields.get("call_id")
    if not isinstance(call_id, str):
        raise RequestError(f"input[{i}].call_id: a string is required in a function_call_output")
    if call_id not in call_ids:
        raise RequestError(
            f"input[{i}].call_id: {call_id!r} answers no earlier function_call (of this input "
            "or of the stored conversation previous_response_id continues)"
        )
    output = fields.get("output")
    if isinstance(output, list):  # content parts: their text
        output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
    if not isinstance(output, str):
        raise RequestError(f"input[{i}].output: a string is required in a function_call_output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


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
    last = previous.conversation[-1]
    if last.get("tool_calls"):
        # The template writes calls its own way, not as the model's tokens: the prompt's carry.
        if not rendered.startswith(previous.prompt_text):
            return None
        return Continuation(list(previous.prompt_ids), rendered[len(previous.prompt_text) :])
    output = last["content"]
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
