"""Tool calls in a model's output, one parser per chat-template family.

A family is recognised from the chat template's text (the markers it teaches the model), not
from the model's name: a fine-tune keeps its base model's template. `split` returns the text
before the first call (the message's content) and the calls: the complete, well-formed ones,
up to the first that is not. Calls only ever get added as the output grows, so a stream can
send each call as soon as it is complete; output with no call in it is all content, as an
`auto` answer in words is.

The calls a grammar forced (`tool_choice` "required" or a named function) are the same in every
family, and read by router/http/forced_calls.py.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text as OpenAI sends it (cut short: as far as it got)

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

    def split(self, text: str, ended: bool = True) -> tuple[str, list[ToolCall]]:
        """The content and the calls of `text`; `ended`: the output is whole (a call it cuts
        off is read as far as it goes)."""
        start = self.call_start(text)
        if start is None:
            return text, []
        calls = self.calls_in(text[start:], ended)
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

    def calls_in(self, text: str, ended: bool) -> list[ToolCall]:
        """The calls of `text`, which starts where the first call does."""
        return _calls(_objects(text), self.new_id)

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)


class HermesParser(ToolParser):
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`,
    one block per call (the last may be cut off by the end of the output)."""

    family = "hermes"
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _LAST_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def calls_in(self, text: str, ended: bool) -> list[ToolCall]:
        blocks = (self._LAST_BLOCK if ended else self._BLOCK).findall(text)
        return _calls([_json(block.strip()) for block in blocks], self.new_id)


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]`. Mistral's template wants
    9 alphanumeric characters in an id. A detokenizer that drops special tokens drops the
    marker, so a reply that is only a JSON array of calls counts too."""

    family = "mistral"
    markers = ("[TOOL_CALLS]",)
    _BARE = '[{"name"'
    _ID_CHARS = string.ascii_letters + string.digits

    def call_start(self, text: str) -> int | None:
        # A reply of bare calls first: where a call starts must not move as the text grows.
        stripped = text.lstrip()
        if stripped.startswith(self._BARE):
            return len(text) - len(stripped)
        return super().call_start(text)

    def held_from(self, text: str) -> int:
        stripped = text.lstrip()
        if self._BARE.startswith(stripped):  # may yet be a reply of bare calls
            return 0
        return super().held_from(text)

    def calls_in(self, text: str, ended: bool) -> list[ToolCall]:
        return super().calls_in(text.removeprefix("[TOOL_CALLS]"), ended)

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

    def calls_in(self, text: str, ended: bool) -> list[ToolCall]:
        return super().calls_in(text.removeprefix("<|python_tag|>"), ended)


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


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


_SEPARATORS = " \t\r\n[],;"


def _objects(text: str) -> list[Any]:
    """The complete JSON values of `text` in order, between separators (a list's brackets and
    commas, Llama's `;`, blanks), up to the first that does not parse."""
    values, at = [], 0
    while True:
        while at < len(text) and text[at] in _SEPARATORS:
            at += 1
        try:
            value, at = _DECODER.raw_decode(text, at)
        except ValueError:
            return values
        values.append(value)


def _calls(values: list[Any], new_id: Callable[[], str]) -> list[ToolCall]:
    """`values` as calls, up to the first that is not one."""
    calls = []
    for value in values:
        call = _call(value, new_id())
        if call is None:
            break
        calls.append(call)
    return calls


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
