"""Tokenization off the router's event loop, a few texts at a time.

A long prompt takes seconds to tokenize; on the event loop that would stall every RPC, health
checks included. Texts go to a small thread pool instead (the tokenizer releases the GIL), so
at most `max_concurrent` of them take CPU from the router at once and the rest queue.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pdserve.tokenizer import Tokenizer

DEFAULT_MAX_CONCURRENT = 2


class BackgroundTokenizer:
    def __init__(self, tokenizer: Tokenizer, max_concurrent: int = DEFAULT_MAX_CONCURRENT) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="tokenize")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, self.tokenizer.encode, text, add_special_tokens
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
