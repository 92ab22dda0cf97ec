"""KV events flowing while `bench control-plane` times routing decisions.

A router's index mirror (pdserve/prefix_index/mirror.py) applies every worker's events on a
thread of the router's process, so its decisions are timed with events flowing: a child
process runs `workers` extra publishers (real `PrefixIndexPublisher`s, registered under their
own names so that the probes' answers do not change) that store new blocks and evict their
oldest ones at `blocks_per_s` in all, in batches as a worker's index feeder sends them.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from collections import deque
from dataclasses import dataclass

BATCH_BLOCKS = 64  # blocks per publish: a prompt's worth, as a feeder sends after a prefill
HELD_BLOCKS = 4096  # each churn worker evicts beyond this, so its set stays bounded


@dataclass(frozen=True)
class Churn:
    redis_url: str
    model: str
    block_size: int
    workers: int = 8
    blocks_per_s: float = 20_000.0


def run_churn(churn: Churn, stop, counts) -> None:
    """The child process: publishes until `stop` is set; counts[0] = blocks published."""
    from pdserve.core.kv_events import KVEvent
    from pdserve.prefix_index.publisher import PrefixIndexPublisher

    rng = random.Random(7)
    publishers = []
    for i in range(churn.workers):
        pub = PrefixIndexPublisher(
            churn.redis_url, f"churn-{i}", churn.model, churn.block_size, heartbeat_ttl_s=30
        )
        pub.register()
        publishers.append((pub, deque()))
    interval = BATCH_BLOCKS / churn.blocks_per_s
    next_at, i, last_beat = time.monotonic(), 0, time.monotonic()
    while not stop.is_set():
        pub, held = publishers[i % len(publishers)]
        new = [rng.getrandbits(63) for _ in range(BATCH_BLOCKS)]
        events = [KVEvent("stored", new, BATCH_BLOCKS * churn.block_size)]
        held.extend(new)
        if len(held) > HELD_BLOCKS:
            old = [held.popleft() for _ in range(BATCH_BLOCKS)]
            events.append(KVEvent("removed", old, BATCH_BLOCKS * churn.block_size))
        pub.publish(events)
        counts[0] += BATCH_BLOCKS * len(events)
        i += 1
        if time.monotonic() - last_beat > 5:
            for p, _ in publishers:
                p.heartbeat()
            last_beat = time.monotonic()
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
    for p, _ in publishers:
        p.unregister()
        p.close()


class ChurnProcess:
    """`with ChurnProcess(churn) as c:` ... `c.blocks_per_s()`: the rate actually published."""

    def __init__(self, churn: Churn) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._counts = ctx.Array("q", 1)
        self._process = ctx.Process(
            target=run_churn, args=(churn, self._stop, self._counts), daemon=True
        )
        self._started = 0.0
        self._published = 0

    def __enter__(self) -> ChurnProcess:
        self._process.start()
        while self._counts[0] == 0 and self._process.is_alive():  # publishing has begun
            time.sleep(0.01)
        self._started, self._published = time.monotonic(), self._counts[0]
        return self

    def blocks_per_s(self) -> float:
        return (self._counts[0] - self._published) / (time.monotonic() - self._started)

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
