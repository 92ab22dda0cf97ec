"""ServedTraffic: the requests this router served lately (prompt and output lengths, arrival
times), kept for the online planner (router/online_plan.py). One per process, like the
metrics; bounded in time and in count."""

from __future__ import annotations

import threading
import time
from collections import deque


class ServedTraffic:
    def __init__(self, max_requests: int = 20_000) -> None:
        self._lock = threading.Lock()
        # (prompt tokens, completion tokens, arrival, perf_counter seconds)
        self._served: deque[tuple[int, int, float]] = deque(maxlen=max_requests)

    def record(self, prompt_tokens: int, completion_tokens: int, arrived_at: float) -> None:
        """One request that produced tokens; `arrived_at` on the perf_counter clock."""
        if prompt_tokens > 0 and completion_tokens > 0:
            with self._lock:
                self._served.append((prompt_tokens, completion_tokens, arrived_at))

    def window(self, seconds: float, now: float | None = None) -> list[tuple[int, int, float]]:
        """The requests that arrived in the last `seconds`, oldest first (older ones dropped)."""
        cutoff = (time.perf_counter() if now is None else now) - seconds
        with self._lock:
            while self._served and self._served[0][2] < cutoff:
                self._served.popleft()
            return sorted(self._served, key=lambda r: r[2])


SERVED = ServedTraffic()
