"""The JSON of OpenAI responses and stream chunks, built from the router's token batches.

One `Choice` per prompt gathers what its batches carried (text, token ids, log-probabilities,
finish reason); the same batches make either one response at the end or one chunk each.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import cached_property
from json.encoder import encode_basestring
from typing import Any

from pdserve.core.messages import TokenBatch
from pdserve.tokenizer import Tokenizer
from router.http.tool_output import ToolOutput
from router.types import Progress

COMPLETION = "text_completion"
CHAT = "chat.completion"
CHAT_CHUNK = "chat.completion.chunk"
# Compact JSON, non-ASCII as is (as OpenAI's own responses).
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def to_json(data: Any) -> str:
    return _JSON.encode(data)


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    progress: Progress
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, batch: TokenBatch) -> None:
        self.text += batch.text
        self.token_ids += batch.token_ids
        self.logprobs += batch.logprobs
        if batch.finished:
            self.finish_reason = batch.finish_reason


@dataclass
class ResponseShape:
    """What every response and chunk of one request shares."""

    id: str
    model: str
    chat: bool
    tokenizer: Tokenizer
    logprobs: bool = False
    return_token_ids: bool = False
    tools: ToolOutput | None = None  # chat read for tool calls
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        return {
            **self._envelope(CHAT if self.chat else COMPLETION),
            "choices": [self._full_choice(c) for c in choices],
            "usage": usage(choices),
        }

    def chunk(
        self, choice: Choice, batch: TokenBatch, first: bool, usage_so_far: dict | None = None
    ) -> str:
        """One stream chunk's JSON: `batch` of `choice` (which has already taken it), and the
        usage when given. Written into the envelope rendered once per request, its strings
        escaped as json.dumps does, rather than built as a dict and dumped: a stream sends one
        chunk per token, and the dict way costs ~5x more per chunk."""
        text = encode_basestring(batch.text)
        if not self.chat:
            body = f'"text":{text}'
        elif first:
            body = f'"delta":{{"role":"assistant","content":{text}}}'
        else:
            body = f'"delta":{{"content":{text}}}'
        logprobs = "null"
        if self.logprobs:
            text_before = len(choice.text) - len(batch.text)
            logprobs = to_json(self._logprobs(batch.token_ids, batch.logprobs, text_before))
        finished = batch.finished and batch.finish_reason is not None
        finish_reason = encode_basestring(batch.finish_reason) if finished else "null"
        if self.chat and self.tools is not None:
            delta, reason = self.tools.delta(choice.index, choice.text, batch, first)
            body = f'"delta":{to_json(delta)}'
            finish_reason = encode_basestring(reason) if finished and reason else finish_reason
        ids = ""
        if self.return_token_ids:
            ids = f',"token_ids":[{_ints(batch.token_ids)}]'
            if first:
                ids += f',"prompt_token_ids":[{_ints(choice.prompt_ids)}]'
        after = "" if usage_so_far is None else f',"usage":{to_json(usage_so_far)}'
        return (
            f'{self._chunk_head}{{"index":{choice.index:d},{body},"logprobs":{logprobs},'
            f'"finish_reason":{finish_reason}{ids}}}]{after}}}'
        )

    def usage_chunk(self, choices: list[Choice]) -> str:
        """The stream's last chunk's JSON: no choice, the usage of all."""
        return to_json(
            {
                **self._envelope(CHAT_CHUNK if self.chat else COMPLETION),
                "choices": [],
                "usage": usage(choices),
            }
        )

    @cached_property
    def _chunk_head(self) -> str:
        """Every chunk's JSON up to its choice: `{"id":…,"model":…,"choices":[`."""
        envelope = to_json(self._envelope(CHAT_CHUNK if self.chat else COMPLETION))
        return envelope[:-1] + ',"choices":['

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _full_choice(self, choice: Choice) -> dict[str, Any]:
        out: dict[str, Any] = {"index": choice.index}
        finish_reason = choice.finish_reason
        if self.chat and self.tools is not None:
            out["message"], finish_reason = self.tools.message(choice.text, finish_reason)
        elif self.chat:
            out["message"] = {"role": "assistant", "content": choice.text}
        else:
            out["text"] = choice.text
        out["logprobs"] = self._logprobs(choice.token_ids, choice.logprobs, 0)
        # The router's reasons are OpenAI's ("stop", "length"), plus "abort"; "tool_calls"
        # when the answer is calls.
        out["finish_reason"] = finish_reason
        if self.return_token_ids:
            out["token_ids"] = choice.token_ids
            out["prompt_token_ids"] = choice.prompt_ids
        return out

    def _logprobs(self, token_ids: list[int], logprobs: list[float], offset: int) -> dict | None:
        """OpenAI's logprobs object of these tokens: the sampled tokens' log-probabilities
        only (no alternatives); None when the request did not ask for them."""
        if not self.logprobs:
            return None
        tokens = [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
        if self.chat:
            return {
                "content": [
                    {
                        "token": token,
                        "logprob": logprob,
                        "bytes": list(token.encode("utf-8")),
                        "top_logprobs": [],
                    }
                    for token, logprob in zip(tokens, logprobs, strict=False)
                ]
            }
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs, strict=False)],
            "text_offset": offsets,
        }


def _ints(values: list[int]) -> str:
    return ",".join(map(str, values))


def usage(choices: list[Choice]) -> dict[str, Any]:
    """Each prompt counted once (its n choices share its Progress)."""
    progresses = list({id(c.progress): c.progress for c in choices}.values())
    prompt = sum(p.prompt_tokens for p in progresses)
    completion = sum(p.completion_tokens for p in progresses)
    cached = sum(p.cached_tokens for p in progresses)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
