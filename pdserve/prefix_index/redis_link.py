"""RedisLink: the one door every prefix-index call goes through, so a dead Redis is harmless.

Contract: `call(fn, default)` never raises a Redis error to the caller. While Redis is
unreachable it returns `default`, `available` is False, the gauge `pdserve_redis_up` is 0,
and one warning is logged per outage. After a failure it does not touch the network again until
a backoff delay has passed (doubling up to `backoff_max_s`), so a hot path such as routing or an
engine step never waits on a dead server for more than one short socket timeout per backoff
period. The first call that succeeds after an outage runs the `on_reconnect` hooks (resync).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.metrics import REDIS_UP

log = logging.getLogger(__name__)
T = TypeVar("T")


def connect(url: str, socket_timeout_s: float) -> redis.Redis:
    """A client for `redis://`, `rediss://` (TLS) or `unix://` URLs, password included.

    redis-py retries failed commands by default; that would multiply the stall on a dead
    server, so retries are off and RedisLink's backoff decides when to try again.
    """
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        decode_responses=True,
    )


class RedisLink:
    """A Redis client plus availability state, backoff and reconnect hooks (thread-safe)."""

    def __init__(
        self,
        url: str,
        *,
        name: str,
        socket_timeout_s: float = 0.3,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = connect(url, socket_timeout_s)
        self.name = name
        self.on_reconnect: list[Callable[[], None]] = []
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._backoff_s = backoff_initial_s
        self._clock = clock
        self._lock = threading.Lock()
        self._available = True  # optimistic until the first call says otherwise
        self._down = False  # an outage was seen and not yet recovered from
        self._retry_at = 0.0
        self._gauge = REDIS_UP  # one Redis client per process: router or worker

    @property
    def available(self) -> bool:
        """False from a failed call until the next call that succeeds."""
        return self._available

    def call(self, fn: Callable[[redis.Redis], T], default: T) -> T:
        """`fn(client)`, or `default` when Redis is unreachable or the call fails."""
        if self._down and self._clock() < self._retry_at:
            return default  # still backing off: do not spend a socket timeout
        try:
            result = fn(self.client)
        except (redis.RedisError, OSError) as exc:
            # Besides connection errors, a refused command (OOM, READONLY replica, auth) also
            # counts as an outage: the index cannot work, and backing off avoids a log flood.
            self._mark_down(exc)
            return default
        if self._down:
            self._mark_up()
        else:
            self._gauge.set(1)  # cheap; keeps the gauge right with several links in a process
        return result

    def ping(self) -> bool:
        """True when Redis answers now (respects the backoff)."""
        return bool(self.call(lambda client: client.ping(), False))

    def close(self) -> None:
        self.client.close()

    def _mark_down(self, exc: Exception) -> None:
        with self._lock:
            first = not self._down
            self._down, self._available = True, False
            if first:
                self._backoff_s = self._backoff_initial_s
            else:
                self._backoff_s = min(self._backoff_s * 2, self._backoff_max_s)
            self._retry_at = self._clock() + self._backoff_s
        self._gauge.set(0)
        if first:
            log.warning("prefix index unavailable: routing on load alone (%s: %s)", self.name, exc)

    def _mark_up(self) -> None:
        with self._lock:
            if not self._down:
                return  # another thread recovered first
            self._down, self._available = False, True
        self._gauge.set(1)
        log.info("prefix index reachable again (%s): resynchronising", self.name)
        for hook in list(self.on_reconnect):
            try:
                hook()
            except Exception:  # a hook must not turn a recovery into a crash
                log.exception("prefix index: reconnect hook failed")
