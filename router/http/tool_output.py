"""A chat choice's output read for tool calls: the message (content and `tool_calls`) and, when
streamed, each chunk's delta.

A stream sends content as it comes, up to where a call may begin (the family's marker, or the
start of one); from there it holds the text back and sends each call once it is complete (its
index, id, type, name and arguments in one delta). Forced calls (a grammar) send no content;
each call's index, id, type and name go as soon as the name is written, then its arguments as
they grow (deltas by index, which the SDK's accumulators join). Held text that turns out not to
be a call is sent at the end, as content; blanks wait for what follows them. The finish reason
is "tool_calls" when the output ended with calls in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.core.messages import TokenBatch
from router.http.forced_calls import forced_calls
from router.http.tool_parsers import ToolCall, ToolParser


@dataclass
class _Streamed:
    content: int = 0  # characters of content sent
    arguments: list[int] = field(default_factory=list)  # of each call sent: characters sent


@dataclass
class ToolOutput:
    parser: ToolParser
    forced: bool  # tool_choice "required" or a named function: the output is a call list
    _streamed: dict[int, _Streamed] = field(default_factory=dict)  # by choice index

    def split(self, text: str, ended: bool = True) -> tuple[str, list[ToolCall]]:
        if self.forced:
            calls = forced_calls(text, self.parser.new_id)
            return ("", calls) if calls else (text, [])
        return self.parser.split(text, ended)

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
        return message, _finish_reason(finish_reason)

    def delta(
        self, index: int, text: str, batch: TokenBatch, first: bool
    ) -> tuple[dict[str, Any], str | None]:
        """The delta of a choice whose text so far is `text` (`batch` taken), and its finish
        reason (None until the last batch)."""
        streamed = self._streamed.setdefault(index, _Streamed())
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        content, calls = self.split(text, ended=batch.finished)
        if batch.finished or calls:
            until = len(content) if content.strip() or not calls else 0
        else:
            # Blanks wait for what follows them: before a call they are no content (the
            # message's is null), and a stream cannot take back what it sent.
            held = 0 if self.forced else self.parser.held_from(text)
            until = len(text[:held].rstrip())
        if until > streamed.content:
            delta["content"] = text[streamed.content : until]
            streamed.content = until
        sent = streamed.arguments
        deltas = [_call_delta(k, call, sent) for k, call in enumerate(calls)]
        if any(deltas):
            delta["tool_calls"] = [d for d in deltas if d]
        if not batch.finished:
            return delta, None
        return delta, _finish_reason(batch.finish_reason) if calls else batch.finish_reason


def _call_delta(index: int, call: ToolCall, sent: list[int]) -> dict[str, Any] | None:
    """What a stream has yet to send of `call` (its arguments only grow); None for nothing."""
    if index == len(sent):
        sent.append(len(call.arguments))
        return {"index": index, **call.openai()}
    if len(call.arguments) == sent[index]:
        return None
    more = call.arguments[sent[index] :]
    sent[index] = len(call.arguments)
    return {"index": index, "function": {"arguments": more}}


def _finish_reason(reason: str | None) -> str | None:
    """An output that ended with calls in it: "tool_calls" (one cut short keeps "length")."""
    return "tool_calls" if reason == "stop" else reason
