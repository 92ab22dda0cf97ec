"""A few threads for work the event loop must not do itself, with a bounded queue.

CPU work on the router's only event loop (tokenizing a long prompt, decoding a large JSON body)
would stall every RPC, health checks included; it runs here instead. A pool with all its threads
busy and `max_waiting` jobs queued refuses the next one at once as Overloaded (the admission
control answer: RESOURCE_EXHAUSTED / HTTP 429), so no queue in front of the workers grows
without bound and a small request never waits behind an unbounded pile of large ones. The
router's admission control counts its jobs as pending requests and may refuse one before the
pool is full (`admission`, set by router/routing.py's `Routing.count`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from router.types import Overloaded

T = TypeVar("T")


class BoundedPool:
    def __init__(self, name: str, max_concurrent: int, max_waiting: int) -> None:
        self.name = name
        self.limit = max_concurrent + max_waiting
        self.outstanding = 0  # jobs running or queued
        # Raises Overloaded when the router holds too many requests already; None = no check.
        self.admission: Callable[[], None] | None = None
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a pool thread; Overloaded at once when the pool (or the router) is
        full."""
        if self.admission is not None:
            self.admission()
        if self.outstanding >= self.limit:
            raise Overloaded(
                f"router overloaded: {self.outstanding} {self.name} jobs running or queued "
                f"(at most {self.limit})"
            )
        self.outstanding += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.outstanding -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
