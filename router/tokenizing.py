"""Tokenization off the router's event loop, a few texts at a time.

A long prompt takes seconds to tokenize; on the event loop that would stall every RPC, health
checks included. Texts go to a small thread pool instead (the tokenizer releases the GIL), so
at most `max_concurrent` of them take CPU from the router at once and the rest queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pdserve.tokenizer import Tokenizer

DEFAULT_MAX_CONCURRENT = 2

T = TypeVar("T")


class BackgroundTokenizer:
    def __init__(self, tokenizer: Tokenizer, max_concurrent: int = DEFAULT_MAX_CONCURRENT) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="tokenize")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, self.tokenizer.encode, text, add_special_tokens
        )

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the same threads: other work on a whole prompt's tokens (a million
        token strings take a second), kept off the event loop and bounded alike."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
