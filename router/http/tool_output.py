"""A chat choice's output read for tool calls: the message (content and `tool_calls`) and, when
streamed, each chunk's delta.

A stream sends content as it comes, up to where a call may begin (the family's marker, or the
start of one); from there it holds the text back, and the last chunk carries the calls (each
with its index, id, type, name and arguments, which the SDK's accumulators take) and finish
reason "tool_calls". Held text that turns out not to be a call is sent then, as content.
Forced calls (a grammar) send no content at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.core.messages import TokenBatch
from router.http.tool_parsers import ToolCall, ToolParser, forced_calls


@dataclass
class ToolOutput:
    parser: ToolParser
    forced: bool  # tool_choice "required" or a named function: the output is a call list
    # Per choice index: characters of content its stream has sent.
    _sent: dict[int, int] = field(default_factory=dict)

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.forced:
            calls = forced_calls(text, self.parser)
            return ("", calls) if calls else (text, [])
        return self.parser.split(text)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The choice's message and finish reason."""
        content, calls = self.split(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {
            "role": "assistant",
            "content": content if content.strip() else None,
            "tool_calls": [call.openai() for call in calls],
        }
        return message, "tool_calls"

    def delta(
        self, index: int, text: str, batch: TokenBatch, first: bool
    ) -> tuple[dict[str, Any], str | None]:
        """The delta of a choice whose text so far is `text` (`batch` taken), and its finish
        reason (None until the last batch)."""
        sent = self._sent.get(index, 0)
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if batch.finished:
            content, calls = self.split(text)
            if content[sent:]:
                delta["content"] = content[sent:]
            if not calls:
                return delta, batch.finish_reason
            delta["tool_calls"] = [{"index": k, **c.openai()} for k, c in enumerate(calls)]
            return delta, "tool_calls"
        until = sent if self.forced else max(sent, self.parser.held_from(text))
        if until > sent:
            delta["content"] = text[sent:until]
            self._sent[index] = until
        return delta, None
