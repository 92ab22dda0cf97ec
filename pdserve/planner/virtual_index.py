"""VirtualIndex: the router's copy of the prefix index (pdserve/prefix_index/mirror.py) on the
planner's virtual clock, fed by the virtual workers' own KV events.

A live worker's events reach the router's mirror after its step (the publisher sends a step's
stores and evictions once the step is done), through Redis's stream and the mirror's reader:
here each step's events are applied `lag_s` after the step ends, so the effect of the mirror's
staleness on routing can be measured by setting the lag to one measured live (`bench
control-plane`). Answers are the mirror's: worker -> leading blocks of the prompt it holds.
Without it (`VirtualCluster(index_lag_s=None)`) the router knows only what it routed.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.core.kv_events import KVEvent
from pdserve.planner.events import EventLoop


class VirtualIndex:
    def __init__(self, loop: EventLoop, lag_s: float = 0.0) -> None:
        if lag_s < 0:
            raise ValueError(f"index lag must be >= 0, got {lag_s}")
        self.lag_s = lag_s
        self._loop = loop
        self._holders: dict[int, set[str]] = {}  # block hash -> workers holding it
        self._pending: dict[str, list[KVEvent]] = {}  # worker -> events of its current step
        self.events = 0  # KV events applied
        self.blocks = 0  # blocks stored or removed by them
        # (block, worker) entries held now and at most: what Redis would store (its memory per
        # entry is measured by `bench control-plane`).
        self.entries = 0
        self.peak_entries = 0

    def sink(self, worker_id: str):
        """The KV event sink of `worker_id`'s engine: holds a step's events until its end."""
        pending = self._pending.setdefault(worker_id, [])
        return pending.extend

    def step_ended(self, worker_id: str) -> None:
        pending = self._pending.get(worker_id)
        if pending:  # emptied in place: the engine's sink is bound to this list
            events = pending[:]
            pending.clear()
            self._loop.after(self.lag_s, lambda: self._apply(worker_id, events))

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """worker_id -> leading blocks of `block_hashes` it holds (prefix-closed caches: a
        worker stops counting at its first missing block)."""
        found: dict[str, int] = {}
        if not block_hashes:
            return found
        walking = self._holders.get(block_hashes[0])
        if not walking:
            return found
        walking = set(walking)
        for depth, h in enumerate(block_hashes[1:], start=1):
            holders = self._holders.get(h, ())
            for worker_id in [w for w in walking if w not in holders]:
                found[worker_id] = depth
                walking.discard(worker_id)
            if not walking:
                return found
        for worker_id in walking:
            found[worker_id] = len(block_hashes)
        return found

    # What `Routing` asks of a PrefixIndex besides lookups: reuse figures go to Redis, which
    # the virtual cluster does not have; the benches count hits from the workers' own stats.
    def in_background(self, fn, *args) -> None:
        fn(*args)

    def record_reuse(self, worker_id: str, hit_tokens: int, miss_tokens: int) -> None:
        pass

    def _apply(self, worker_id: str, events: list[KVEvent]) -> None:
        holders = self._holders
        for event in events:
            self.events += 1
            self.blocks += len(event.block_hashes)
            if event.kind == "stored":
                for h in event.block_hashes:
                    held = holders.setdefault(h, set())
                    if worker_id not in held:
                        held.add(worker_id)
                        self.entries += 1
                self.peak_entries = max(self.peak_entries, self.entries)
            else:
                for h in event.block_hashes:
                    held = holders.get(h)
                    if held is not None and worker_id in held:
                        held.remove(worker_id)
                        self.entries -= 1
                        if not held:
                            del holders[h]

    @property
    def distinct_blocks(self) -> int:
        return len(self._holders)
