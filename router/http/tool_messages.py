"""A conversation's tool calls and results, checked and put in the form chat templates read.

An assistant message's `tool_calls` come as OpenAI sends them (arguments as JSON text);
templates print the arguments with `tojson`, so they get them parsed, as transformers documents
and vLLM does. A `tool` message must answer a call made earlier in the conversation.
"""

from __future__ import annotations

import json
from typing import Any

from router.validation import RequestError


def with_tool_calls_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each call's arguments parsed; RequestError naming the bad field."""
    call_ids: set[str] = set()
    out = []
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        role = message["role"]
        if "tool_calls" in message:
            if role != "assistant":
                raise RequestError(f"{field}.tool_calls: only assistant messages make tool calls")
            message = {**message, "tool_calls": _calls(field, message["tool_calls"], call_ids)}
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise RequestError(f"{field}.tool_call_id: required in a 'tool' message")
            if call_id not in call_ids:
                raise RequestError(
                    f"{field}.tool_call_id: {call_id!r} answers no tool call of an earlier "
                    "assistant message"
                )
            if message.get("content") is None:
                raise RequestError(f"{field}.content: a 'tool' message carries the result")
        out.append(message)
    return out


def _calls(field: str, calls: Any, call_ids: set[str]) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not calls:
        raise RequestError(f"{field}.tool_calls: a non-empty list is required")
    out = []
    for j, call in enumerate(calls):
        where = f"{field}.tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("id"), str):
            raise RequestError(f"{where}.id: a string is required")
        if call.get("type", "function") != "function":
            raise RequestError(f"{where}.type: must be 'function'")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{where}.function.name: a string is required")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                raise RequestError(f"{where}.function.arguments: not valid JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise RequestError(f"{where}.function.arguments: must be a JSON object")
        call_ids.add(call["id"])
        out.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return out
