"""ApproximatePrefixes: what each worker's prefix cache probably holds, predicted from the
prompts the router sent it, with no KV events (the `approximate` policy, router/policy.py).

This is the view vllm-router's and sglang's `cache_aware` policies and llm-d's approximate
prefix scorer route by: per worker, the blocks it was sent, evicted least recently sent first
once they outgrow the worker's KV pool (`capacity`, its stats' `num_blocks`). It exists so the
value of the event-fed index (Redis and the router's mirror of it) is measured against the
best a router can do without it, not assumed. Where it errs: a worker's pool also holds its
running sequences and decode tokens, so it evicts sooner than this predicts, and it evicts
nothing it was never sent; a router that restarts starts empty.

A prompt's blocks are inserted last block first, so the first blocks, which more prompts
share, are the youngest and leave last, as the engine's own LRU releases a sequence tail first.
Not thread-safe (the router's event loop owns it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence


class ApproximatePrefixes:
    def __init__(self) -> None:
        # worker -> block hash -> None, least recently sent first
        self._held: dict[str, OrderedDict[int, None]] = {}

    def add(self, worker_id: str, block_hashes: Sequence[int], capacity: int) -> None:
        """`block_hashes` were sent to `worker_id`, whose pool holds `capacity` blocks (0:
        unknown, nothing is evicted)."""
        held = self._held.get(worker_id)
        if held is None:
            held = self._held[worker_id] = OrderedDict()
        move = held.move_to_end
        for h in reversed(block_hashes):
            if h in held:
                move(h)
            else:
                held[h] = None
        if capacity:
            while len(held) > capacity:
                held.popitem(last=False)

    def lookup(self, block_hashes: Sequence[int], worker_ids: Collection[str]) -> dict[str, int]:
        """worker_id -> leading blocks of `block_hashes` it is predicted to hold (> 0 only)."""
        if not block_hashes:
            return {}
        first, found = block_hashes[0], {}
        for worker_id, held in self._held.items():
            if first not in held or worker_id not in worker_ids:
                continue
            count = 1
            for h in block_hashes[1:]:
                if h not in held:
                    break
                count += 1
            found[worker_id] = count
        return found

    def held_blocks(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

    def forget(self, worker_id: str) -> None:
        """The worker restarted: its cache is empty."""
        self._held.pop(worker_id, None)
