"""RecentPrefixes: prompt blocks the router just sent to a worker, before the index shows them.

A worker publishes a block to the Redis index only once it has computed it, and a prompt may
wait in the worker's queue for seconds before that. Meanwhile the index says nobody holds the
prefix, so the next requests of a burst sharing it would be spread over other workers, each
computing the prefix again. The router knows better: it remembers, for `ttl_s`, the full
blocks of every prompt it routed, per worker, and lookups take the larger of the two views.
A wrong entry (the request failed) costs one recomputation, never a wrong answer: workers
check every cache hit themselves. Not thread-safe (the router's event loop owns it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence


class RecentPrefixes:
    def __init__(self, ttl_s: float = 10.0, max_blocks: int = 1 << 17,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        # (worker_id, block hash) -> expiry, oldest first (an entry moves to the end on reuse).
        self._expiry: OrderedDict[tuple[str, int], float] = OrderedDict()

    def add(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        expiry = self._clock() + self.ttl_s
        for h in block_hashes:
            key = (worker_id, h)
            self._expiry[key] = expiry
            self._expiry.move_to_end(key)
        while len(self._expiry) > self.max_blocks:
            self._expiry.popitem(last=False)

    def lookup(self, block_hashes: Sequence[int], worker_ids: Sequence[str]) -> dict[str, int]:
        """worker_id -> leading blocks of `block_hashes` routed there within the TTL."""
        self._expire()
        found = {}
        for worker_id in worker_ids:
            count = 0
            for h in block_hashes:
                if (worker_id, h) not in self._expiry:
                    break
                count += 1
            if count:
                found[worker_id] = count
        return found

    def forget(self, worker_id: str) -> None:
        """The worker restarted: whatever it was sent is gone with its old cache."""
        for key in [k for k in self._expiry if k[0] == worker_id]:
            del self._expiry[key]

    def _expire(self) -> None:
        now = self._clock()
        while self._expiry:
            key, expiry = next(iter(self._expiry.items()))
            if expiry > now:
                return
            del self._expiry[key]


def merge(*views: Mapping[str, int]) -> dict[str, int]:
    """worker_id -> the most leading blocks any view credits it with."""
    merged: dict[str, int] = {}
    for view in views:
        for worker_id, blocks in view.items():
            merged[worker_id] = max(merged.get(worker_id, 0), blocks)
    return merged
