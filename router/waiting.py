"""Requests waiting on the request path outside any pool, counted.

RequestFlow holds a request whose workers are full for up to `room_wait_s`, retrying; such a
request holds no worker and no pool thread, yet the router holds it. Admission control counts
these as pending requests (router/routing.py's `Routing.count`), and refuses one about to wait
when max_pending_requests are pending already, as a full pool refuses a job
(router/bounded_pool.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


class WaitingRequests:
    def __init__(self, name: str) -> None:
        self.name = name
        self.outstanding = 0  # requests waiting now
        # Raises Overloaded when the router holds too many requests already; None = no check.
        self.admission: Callable[[], None] | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        """One request waiting for the block's duration; Overloaded at once if refused."""
        if self.admission is not None:
            self.admission()
        self.outstanding += 1
        try:
            yield
        finally:
            self.outstanding -= 1
