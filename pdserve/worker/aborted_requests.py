"""The request ids a worker was told to abort, remembered for calls that arrive after their abort.

Ray does not order an async actor's calls: the router's abort() of an attempt may run before the
reserve(), generate() or prefill() it aborts has started. A worker that forgot the abort would
then compute the request, or reserve blocks for it, that nobody will ever read or free before
a deadline. Request ids are unique per attempt (a retry gets `#n`), so a remembered id never
refuses later work. The router aborts every attempt when it ends, so the memory is bounded: a
call starts within seconds of its abort, long before thousands of later attempts push it out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

REMEMBERED = 4096


class AbortedRequests:
    """The latest REMEMBERED aborted ids; safe to read from the engine thread while the event
    loop adds."""

    def __init__(self, capacity: int = REMEMBERED) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, request_id: str) -> None:
        with self._lock:
            self._ids[request_id] = None
            self._ids.move_to_end(request_id)
            while len(self._ids) > self._capacity:
                self._ids.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._ids
