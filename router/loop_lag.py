"""How long the router's own event loop has stalled: a CPU-throttled pod (a Kubernetes CPU
limit), a long garbage collection, a starved host. While its loop stalls the router sends no
heartbeat and reads no answer, so a worker's silence over that time says nothing about the
worker: the pool (router/worker_pool.py) counts silence net of this. Without it, one 4 s stall
of the router's loop marked every worker unhealthy at once and requests failed with "no
healthy decode worker" (seen in CI on a loaded 2-core host)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# A ticker this often; a stall shorter than a tick is counted when the tick comes due.
TICK_S = 0.05
LOGGED_STALL_S = 1.0  # a stall this long is worth a line in the log


class LoopLag:
    """Seconds the event loop has woken late, summed since `run_forever` started."""

    def __init__(self, tick_s: float = TICK_S) -> None:
        self._tick_s = tick_s
        self._recorded_s = 0.0
        self._due: float | None = None  # when the ticker's current sleep should end
        # Each tick's lateness in seconds, e.g. to a Prometheus counter (pdserve/app wires
        # pdserve_router_loop_stall_seconds_total: the planner's virtual cluster builds this
        # router's pool too and must not load the metrics' gRPC).
        self.listeners: list[Callable[[float], None]] = []

    async def run_forever(self) -> None:
        while True:
            self._due = time.monotonic() + self._tick_s
            await asyncio.sleep(self._tick_s)
            late = max(0.0, time.monotonic() - self._due)
            self._recorded_s += late
            for listener in self.listeners:
                listener(late)
            if late >= LOGGED_STALL_S:
                log.warning(
                    "the router's event loop stalled for %.1f s (CPU throttled or starved, a "
                    "long GC?): workers' missed heartbeats meanwhile are not held against them",
                    late,
                )

    def total_s(self) -> float:
        """The lateness so far, with that of a tick that is due but has not run yet: code that
        runs first after a stall sees the stall."""
        pending = 0.0 if self._due is None else max(0.0, time.monotonic() - self._due)
        return self._recorded_s + pending

    def net_since(self, then: float, lag_then: float) -> float:
        """Seconds since `then` (time.monotonic()) during which the loop ran, `lag_then` being
        `total_s()` at that time."""
        return time.monotonic() - then - (self.total_s() - lag_then)
