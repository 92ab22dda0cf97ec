"""The JSON of OpenAI responses and stream chunks, built from the router's token batches.

One `Choice` per prompt gathers what its batches carried (text, token ids, log-probabilities,
finish reason); the same batches make either one response at the end or one chunk each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.core.messages import TokenBatch
from pdserve.tokenizer import Tokenizer
from router.types import Progress

COMPLETION = "text_completion"
CHAT = "chat.completion"
CHAT_CHUNK = "chat.completion.chunk"


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
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        return {
            **self._envelope(CHAT if self.chat else COMPLETION),
            "choices": [self._full_choice(c) for c in choices],
            "usage": usage(choices),
        }

    def chunk(self, choice: Choice, batch: TokenBatch, first: bool) -> dict:
        """One stream chunk: `batch` of `choice` (which has already taken it)."""
        out: dict[str, Any] = {"index": choice.index}
        text_before = len(choice.text) - len(batch.text)
        logprobs = self._logprobs(batch.token_ids, batch.logprobs, text_before)
        if self.chat:
            out["delta"] = (
                {"role": "assistant", "content": batch.text} if first else {"content": batch.text}
            )
        else:
            out["text"] = batch.text
        out["logprobs"] = logprobs
        out["finish_reason"] = batch.finish_reason if batch.finished else None
        if self.return_token_ids:
            out["token_ids"] = batch.token_ids
            if first:
                out["prompt_token_ids"] = choice.prompt_ids
        return {**self._envelope(CHAT_CHUNK if self.chat else COMPLETION), "choices": [out]}

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return {
            **self._envelope(CHAT_CHUNK if self.chat else COMPLETION),
            "choices": [],
            "usage": usage(choices),
        }

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _full_choice(self, choice: Choice) -> dict[str, Any]:
        out: dict[str, Any] = {"index": choice.index}
        if self.chat:
            out["message"] = {"role": "assistant", "content": choice.text}
        else:
            out["text"] = choice.text
        out["logprobs"] = self._logprobs(choice.token_ids, choice.logprobs, 0)
        # The router's reasons are OpenAI's ("stop", "length"), plus "abort".
        out["finish_reason"] = choice.finish_reason
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


def usage(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(c.progress.prompt_tokens for c in choices)
    completion = sum(c.progress.completion_tokens for c in choices)
    cached = sum(c.progress.cached_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
