"""Tool calls in a model's output, one parser per chat-template family.

A family is recognised from the chat template's text (the markers it teaches the model), not
from the model's name: a fine-tune keeps its base model's template. `split` returns the text
before the first call (the message's content) and the calls; output that does not parse as
calls is all content, as an `auto` answer in words is.

The calls a grammar forced (`tool_choice` "required" or a named function) are the same in every
family: a JSON array of `{"name": ..., "arguments": {...}}` (`forced_calls`).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolParser:
    """A family's call syntax. `markers`: text that starts a call; a stream holds its content
    back from the first one (or what may become one)."""

    family = ""
    markers: tuple[str, ...] = ()

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        start = self.call_start(text)
        if start is None:
            return text, []
        calls = self.parse_calls(text[start:])
        return (text[:start], calls) if calls else (text, [])

    def call_start(self, text: str) -> int | None:
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held_from(self, text: str) -> int:
        """Where a stream stops sending content: the first marker, or a tail of `text` that
        a marker may start with."""
        start = self.call_start(text)
        if start is not None:
            return start
        for i in range(max(0, len(text) - max(map(len, self.markers))), len(text)):
            if any(m.startswith(text[i:]) for m in self.markers):
                return i
        return len(text)

    def parse_calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)


class HermesParser(ToolParser):
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`,
    one block per call (the last may be cut off by the end of the output)."""

    family = "hermes"
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for block in self._BLOCK.findall(text):
            call = _call(_json(block.strip()), self.new_id())
            if call is None:
                return []
            calls.append(call)
        return calls


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]`. Mistral's template wants
    9 alphanumeric characters in an id. A detokenizer that drops special tokens drops the
    marker, so a reply that is only a JSON array of calls counts too."""

    family = "mistral"
    markers = ("[TOOL_CALLS]",)
    _ID_CHARS = string.ascii_letters + string.digits

    _BARE = '[{"name"'

    def call_start(self, text: str) -> int | None:
        start = super().call_start(text)
        if start is None and text.lstrip().startswith(self._BARE):
            return len(text) - len(text.lstrip())
        return start

    def held_from(self, text: str) -> int:
        stripped = text.lstrip()
        if self._BARE.startswith(stripped):  # may yet be a reply of bare calls
            return 0
        return super().held_from(text)

    def parse_calls(self, text: str) -> list[ToolCall]:
        return _call_list(_json(text.removeprefix("[TOOL_CALLS]").strip()), self.new_id)

    def new_id(self) -> str:
        return "".join(secrets.choice(self._ID_CHARS) for _ in range(9))


class Llama3Parser(ToolParser):
    """Llama 3.x JSON calls: the whole reply is `{"name": ..., "parameters": {...}}` (several
    joined by `;`), after `<|python_tag|>` when the model writes it."""

    family = "llama3"
    markers = ("<|python_tag|>", "{")

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.markers):
            return len(text) - len(stripped)
        return None

    def held_from(self, text: str) -> int:
        # A call is a whole reply: only its first characters can start one.
        stripped = text.lstrip()
        if not stripped or any(
            m.startswith(stripped) or stripped.startswith(m) for m in self.markers
        ):
            return 0
        return len(text)

    def parse_calls(self, text: str) -> list[ToolCall]:
        text = text.strip().removeprefix("<|python_tag|>").strip()
        calls = []
        while text:
            try:
                value, end = _DECODER.raw_decode(text)
            except ValueError:
                return []
            call = _call(value, self.new_id())
            if call is None:
                return []
            calls.append(call)
            text = text[end:].strip().removeprefix(";").strip()
        return calls


PARSERS = {p.family: p for p in (HermesParser(), MistralParser(), Llama3Parser())}


def parser_for_template(source: str) -> ToolParser:
    """The family whose markers the template teaches; Hermes's (the most common) otherwise."""
    if "[TOOL_CALLS]" in source:
        return PARSERS["mistral"]
    if "<tool_call>" in source:
        return PARSERS["hermes"]
    if "<|python_tag|>" in source or ("ipython" in source and '"parameters"' in source):
        return PARSERS["llama3"]
    return PARSERS["hermes"]


def forced_calls(text: str, parser: ToolParser) -> list[ToolCall]:
    """The calls of an output a tool grammar forced (a JSON array of calls); [] if it was cut
    short."""
    return _call_list(_json(text), parser.new_id)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call_list(value: Any, new_id) -> list[ToolCall]:
    if not isinstance(value, list):
        return []
    calls = [_call(item, new_id()) for item in value]
    return [] if None in calls else calls  # type: ignore[return-value]


def _call(value: Any, call_id: str) -> ToolCall | None:
    """`{"name": ..., "arguments" (or Llama's "parameters"): {...}}` as a ToolCall."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _json(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call_id, value["name"], json.dumps(arguments, ensure_ascii=False))
