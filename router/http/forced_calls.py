"""The output of forced tool calls (the grammar of router/http/tool_request.py), read as it grows.

The grammar writes `[{"name": "<name>", "arguments": {...}}, ...]`, the name first (xgrammar
writes properties in the schema's order). A call counts once its name is complete, and its
arguments are the output's own text of the arguments object, as far as it goes: a stream sends
them as they grow, and an output cut short by `max_tokens` keeps its last call with the
arguments it got to, as OpenAI returns a call cut short.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from router.http.tool_parsers import ToolCall

_DECODER = json.JSONDecoder()
# Up to a call's arguments: the list's `[` or `,`, then `{"name": "...", "arguments": `.
_HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_CLOSE = re.compile(r"\s*\}")


def forced_calls(text: str, new_id: Callable[[], str]) -> list[ToolCall]:
    calls: list[ToolCall] = []
    at = 0
    while head := _HEAD.match(text, at):
        name, start = json.loads(head.group(1)), head.end()
        try:
            _, end = _DECODER.raw_decode(text, start)
        except ValueError:  # the arguments are still being written, or were cut short
            calls.append(ToolCall(new_id(), name, text[start:]))
            return calls
        calls.append(ToolCall(new_id(), name, text[start:end]))
        close = _CLOSE.match(text, end)
        if close is None:
            return calls
        at = close.end()
    return calls
