"""Tokenization off the router's event loop, a few texts at a time, the queue bounded.

A long prompt takes a while to tokenize; on the event loop that would stall every RPC, health
checks included. Texts go to a small thread pool instead (the tokenizer releases the GIL), so
at most `max_concurrent` of them take CPU from the router at once; up to `max_waiting` more
queue, and beyond that a request is refused at once (RESOURCE_EXHAUSTED / 429) instead of
waiting behind them (router/bounded_pool.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pdserve.tokenizer import Tokenizer
from router.bounded_pool import BoundedPool

DEFAULT_MAX_CONCURRENT = 2
# With prompts capped at the context's worth of bytes (router/validation.py), a full queue is
# a fraction of a second of tokenizing: the longest a small request waits here.
DEFAULT_MAX_WAITING = 16

T = TypeVar("T")


class BackgroundTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        max_waiting: int = DEFAULT_MAX_WAITING,
    ) -> None:
        self.tokenizer = tokenizer
        self.pool = BoundedPool("tokenize", max_concurrent, max_waiting)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.pool.run(self.tokenizer.encode, text, add_special_tokens)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the same threads: other work on a whole prompt's tokens (a million
        token strings take a second), kept off the event loop and bounded alike."""
        return await self.pool.run(fn, *args)

    def close(self) -> None:
        self.pool.close()
