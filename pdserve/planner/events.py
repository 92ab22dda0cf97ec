"""EventLoop: the virtual clock of the offline planner, a heap of timed callbacks.

Nothing sleeps: `run` pops the earliest event, sets `now` to its time and calls it; callbacks
schedule later events. Events at the same time run in the order they were scheduled.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, time: float, callback: Callable[[], None]) -> None:
        """Runs `callback` at virtual `time` (now, if that has passed)."""
        heapq.heappush(self._heap, (max(time, self.now), next(self._order), callback))

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        self.at(self.now + delay, callback)

    def run(self, stop: Callable[[], bool]) -> None:
        """Runs events in time order until none is left or `stop()` is true after one."""
        heap = self._heap
        while heap and not stop():
            self.now, _, callback = heapq.heappop(heap)
            callback()
