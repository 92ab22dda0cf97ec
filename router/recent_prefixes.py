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

import itertools
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

# The block table is split by hash into this many dicts: a dict grows (and, as entries come and
# go, compacts) by rebuilding itself whole, ~4 ms at 100k entries, inside whichever routing
# decision adds the entry that triggers it; a 64th of them rebuilds in ~0.1 ms.
SHARDS = 64


@dataclass
class _Route:
    """One `add`: its blocks were sent to `worker_id` and are remembered until `expiry`."""

    serial: int
    worker_id: str
    block_hashes: tuple[int, ...]
    expiry: float


class RecentPrefixes:
    def __init__(self, ttl_s: float = 10.0, max_blocks: int = 1 << 17,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        """At most `max_blocks` (worker, block) entries: beyond, the oldest routes are
        forgotten whole."""
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        # Block hash -> {worker: serial of the latest route that sent it there}, in shard
        # `hash % SHARDS`. A lookup walks the prompt once for all workers (each block narrows
        # the set still walking) instead of once per worker.
        self._shards: list[dict[int, dict[str, int]]] = [{} for _ in range(SHARDS)]
        self._entries = 0  # (worker, block) pairs in the shards
        # Every route in order, hence by expiry. A route forgets only the pairs it was the
        # latest to send: one renewed by a later route stays until that one goes. So a route
        # costs two dict operations per block to add and one lookup each to forget, where an
        # ordered map of pairs moved on every renewal cost several.
        self._routes: deque[_Route] = deque()
        self._routed_blocks = 0  # blocks of the routes in `_routes` (renewed ones included)
        self._serials = itertools.count()

    def add(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        route = _Route(next(self._serials), worker_id, tuple(block_hashes),
                       self._clock() + self.ttl_s)  # fmt: skip
        shards, serial, new = self._shards, route.serial, 0
        for h in route.block_hashes:
            holders = shards[h % SHARDS]
            held = holders.get(h)
            if held is None:
                holders[h] = {worker_id: serial}
                new += 1
            else:
                new += worker_id not in held
                held[worker_id] = serial
        self._entries += new
        self._routes.append(route)
        self._routed_blocks += len(route.block_hashes)
        # Renewals leave old routes behind: they are bounded too, by twice the entries.
        while self._entries > self.max_blocks or self._routed_blocks > 2 * self.max_blocks:
            self._forget_oldest()

    def lookup(self, block_hashes: Sequence[int], worker_ids: Collection[str]) -> dict[str, int]:
        """worker_id (of `worker_ids`) -> leading blocks of `block_hashes` routed there within
        the TTL. Chained hashes: a worker stops at its first missing block."""
        self._expire()
        shards = self._shards
        first = shards[block_hashes[0] % SHARDS].get(block_hashes[0]) if block_hashes else None
        if not first:
            return {}
        walking = {w for w in first if w in worker_ids}
        found: dict[str, int] = {}
        depth = 1  # leading blocks every worker still walking holds
        for i in range(1, len(block_hashes) if walking else 0):
            h = block_hashes[i]
            held = shards[h % SHARDS].get(h)
            if held is None:
                break
            if not walking <= held.keys():
                for worker_id in walking - held.keys():
                    found[worker_id] = depth
                walking &= held.keys()
                if not walking:
                    break
            depth += 1
        for worker_id in walking:
            found[worker_id] = depth
        return found

    def forget(self, worker_id: str) -> None:
        """The worker restarted: whatever it was sent is gone with its old cache."""
        for holders in self._shards:
            for h in [h for h, held in holders.items() if worker_id in held]:
                held = holders[h]
                del held[worker_id]
                self._entries -= 1
                if not held:
                    del holders[h]

    def _expire(self) -> None:
        now, routes = self._clock(), self._routes
        while routes and routes[0].expiry <= now:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        route = self._routes.popleft()
        self._routed_blocks -= len(route.block_hashes)
        shards, worker_id, serial, dropped = self._shards, route.worker_id, route.serial, 0
        for h in route.block_hashes:
            holders = shards[h % SHARDS]
            held = holders.get(h)
            if held is not None and held.get(worker_id) == serial:  # not renewed since
                del held[worker_id]
                dropped += 1
                if not held:
                    del holders[h]
        self._entries -= dropped


def merge(*views: Mapping[str, int]) -> dict[str, int]:
    """worker_id -> the most leading blocks any view credits it with."""
    merged: dict[str, int] = {}
    for view in views:
        for worker_id, blocks in view.items():
            merged[worker_id] = max(merged.get(worker_id, 0), blocks)
    return merged
