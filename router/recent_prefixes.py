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
from dataclasses import dataclass, field

# A worker's table is rebuilt without its forgotten entries once it holds this many more than
# twice the blocks of the worker's remembered routes: rebuilding a small table often would cost
# more than the rebuilds save.
SLACK = 1024


@dataclass
class _Held:
    """One worker's memory: block hash -> serial of the latest route that sent it there. An
    entry counts while its route is remembered (serial >= the oldest remembered route's)."""

    serials: dict[int, int] = field(default_factory=dict)
    routed_blocks: int = 0  # blocks of this worker's remembered routes (renewed ones included)


@dataclass
class _Route:
    """One `add`: its blocks were sent to `worker_id` and are remembered until `expiry`."""

    serial: int
    worker_id: str
    held: _Held
    blocks: int
    first: int  # its first block's hash
    expiry: float


class RecentPrefixes:
    def __init__(self, ttl_s: float = 10.0, max_blocks: int = 1 << 18,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        """At most `max_blocks` blocks in the remembered routes (a block sent twice counts
        twice): beyond, the oldest routes are forgotten whole."""
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        # A route's blocks go into its worker's table in one C-level `dict.update` and are
        # never deleted one by one: routes are forgotten oldest first, so forgetting one moves
        # `_oldest` past its serial, and an entry older than that no longer counts. Each block
        # cost two dict operations to add and one to forget when entries were deleted, half of
        # a routing decision at 256-block prompts.
        self._held: dict[str, _Held] = {}
        self._oldest = 0  # serial of the oldest route still remembered
        # First block hash -> {worker: serial of the latest route starting with it}: with
        # chained hashes a worker holds a prompt's prefix only if one of its routes starts with
        # the prompt's first block, so a lookup visits those workers alone.
        self._first: dict[int, dict[str, int]] = {}
        self._routes: deque[_Route] = deque()  # in serial order, hence by expiry
        self._routed_blocks = 0  # blocks of the routes in `_routes`
        self._serials = itertools.count()

    def add(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        if not block_hashes:
            return
        serial = next(self._serials)
        held = self._held.get(worker_id)
        if held is None:
            held = self._held[worker_id] = _Held()
        held.serials.update(dict.fromkeys(block_hashes, serial))
        blocks = len(block_hashes)
        held.routed_blocks += blocks
        first = block_hashes[0]
        self._first.setdefault(first, {})[worker_id] = serial
        self._routes.append(_Route(serial, worker_id, held, blocks, first,
                                   self._clock() + self.ttl_s))  # fmt: skip
        self._routed_blocks += blocks
        while self._routed_blocks > self.max_blocks:
            self._forget_oldest()
        if len(held.serials) > 2 * held.routed_blocks + SLACK:
            # Every entry still counting belongs to a remembered route, so at most
            # `routed_blocks` stay: the table's size stays within twice what it remembers.
            oldest = self._oldest
            held.serials = {h: s for h, s in held.serials.items() if s >= oldest}

    def lookup(self, block_hashes: Sequence[int], worker_ids: Collection[str]) -> dict[str, int]:
        """worker_id (of `worker_ids`) -> leading blocks of `block_hashes` routed there within
        the TTL. Chained hashes: a worker stops at its first missing block."""
        self._expire()
        starting = self._first.get(block_hashes[0]) if block_hashes else None
        if not starting:
            return {}
        oldest, n, found = self._oldest, len(block_hashes), {}
        for worker_id in starting:
            held = self._held.get(worker_id)
            if held is None or worker_id not in worker_ids:
                continue
            serials = held.serials
            if serials.get(block_hashes[0], -1) < oldest:
                continue
            # A remembered route that sent block i sent every block before it (chained
            # hashes), and a later route renewing one keeps it: a worker's blocks are a prefix
            # of the prompt, found by bisection. `low` blocks are held, `high` are not.
            low, high = 1, n + 1
            while high - low > 1:
                mid = (low + high) // 2
                if serials.get(block_hashes[mid - 1], -1) >= oldest:
                    low = mid
                else:
                    high = mid
            found[worker_id] = low
        return found

    def remembered_blocks(self, worker_id: str) -> int:
        """The distinct blocks routed to the worker within the TTL: the prefixes its requests
        use now, cached there once computed, held by a request or not. A scan of the worker's
        table: the router counts them as each poll arrives (router/routing.py), not per decision."""
        self._expire()
        held = self._held.get(worker_id)
        return sum(map(self._oldest.__le__, held.serials.values())) if held else 0

    def forget(self, worker_id: str) -> None:
        """The worker restarted: whatever it was sent is gone with its old cache."""
        self._held.pop(worker_id, None)  # its remembered routes keep the old table, alone

    def _expire(self) -> None:
        now, routes = self._clock(), self._routes
        while routes and routes[0].expiry <= now:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        route = self._routes.popleft()
        self._oldest = route.serial + 1
        self._routed_blocks -= route.blocks
        held = route.held
        held.routed_blocks -= route.blocks
        if not held.routed_blocks and self._held.get(route.worker_id) is held:
            del self._held[route.worker_id]  # nothing of it is remembered
        starting = self._first.get(route.first)
        if starting is not None and starting.get(route.worker_id) == route.serial:
            del starting[route.worker_id]
            if not starting:
                del self._first[route.first]


def merge(*views: Mapping[str, int]) -> dict[str, int]:
    """worker_id -> the most leading blocks any view credits it with."""
    merged: dict[str, int] = {}
    for view in views:
        for worker_id, blocks in view.items():
            merged[worker_id] = max(merged.get(worker_id, 0), blocks)
    return merged
