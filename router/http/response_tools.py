"""Function tools on `/v1/responses`, through chat's tool code (router/http/tool_request.py,
tool_parsers.py, tool_output.py): no second parser or grammar builder.

The Responses API spells a tool flat (`{"type": "function", "name", "parameters", ...}`) and a
named choice as `{"type": "function", "name"}`; chat nests both under "function". The request
is turned into chat's shape, checked and constrained as chat's is, and chat's error messages
are given back in the Responses spelling. The output's calls become `function_call` items;
their ids are those of the first reading of each call, so that a stream's items and the
response that ends it (and the stored conversation) name the same calls.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from router.http.tool_output import ToolOutput
from router.http.tool_parsers import ToolCall
from router.validation import RequestError

_CHOICES = ("auto", "none", "required")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """`tools` in chat's nested shape; RequestError naming a tool of another type."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RequestError(f"tools[{i}]: an object is required")
        kind = tool.get("type")
        if kind != "function":
            raise RequestError(
                f"tools[{i}].type: {kind!r} tools are not supported; only 'function' tools"
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`tool_choice` in chat's shape; RequestError for one of neither shape."""
    if choice is None or choice in _CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise RequestError("tool_choice.name: a string is required")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(
        "tool_choice: must be 'auto', 'none', 'required' or "
        f'{{"type": "function", "name": ...}}, got {choice!r}'
    )


def responses_names(message: str) -> str:
    """A chat tool error's message with the fields as the Responses body spells them."""
    return message.replace("].function.", "].").replace("tool_choice.function.", "tool_choice.")


def function_call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


@dataclass
class ResponseTools:
    """One response's output read for function calls."""

    output: ToolOutput
    # Of each call, by its place in the output: its item id and call id as first read.
    item_ids: list[str] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole output's content (the message's text) and its calls."""
        content, calls = self.output.split(text)
        return content, [self.stable(k, call) for k, call in enumerate(calls)]

    def stable(self, index: int, call: ToolCall) -> ToolCall:
        """`call` with the ids of the call at `index` as first read (new ones the first time)."""
        if index == len(self.call_ids):
            self.call_ids.append(call.id)
            self.item_ids.append("fc_" + secrets.token_hex(12))
        return ToolCall(self.call_ids[index], call.name, call.arguments)

    def item(self, index: int, call: ToolCall, status: str) -> dict[str, Any]:
        """The function_call item of the call at `index` (read: `stable` has named it)."""
        return function_call_item(self.item_ids[index], call, status)

    def assistant_message(self, text: str) -> dict[str, Any]:
        """The output as the chat message a continuation renders (calls as `tool_calls`)."""
        content, calls = self.split(text)
        if not calls:
            return {"role": "assistant", "content": text}
        return {
            "role": "assistant",
            "content": content if content.strip() else None,
            "tool_calls": [call.openai() for call in calls],
        }
