"""RedisLink: the one door every prefix-index call goes through, so a dead Redis is harmless.

Contract: `call(fn, default)` never raises a Redis error to the caller. While Redis is
unreachable it returns `default`, `available` is False, the gauge `pdserve_redis_up` is 0,
and one warning is logged per outage. After a failure it does not touch the network again until
a backoff delay has passed (doubling up to `backoff_max_s`), so a hot path such as routing or an
engine step never waits on a dead server for more than one short socket timeout per backoff
period. The first call that succeeds after an outage runs the `on_reconnect` hooks (resync).
`acall` is the same door for a caller on an event loop (the router's): its commands go through
an asyncio client of that loop, so the loop serves other work while Redis answers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.metrics import REDIS_UP

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_ASYNC_CONNECTIONS = 16  # per event loop (see connect_async)


def _client_options(socket_timeout_s: float) -> dict:
    """redis-py retries failed commands by default; that would multiply the stall on a dead
    server, so retries are off and RedisLink's backoff decides when to try again."""
    return {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
        "retry_on_timeout": False,
        "decode_responses": True,
    }


def connect(url: str, socket_timeout_s: float) -> redis.Redis:
    """A client for `redis://`, `rediss://` (TLS) or `unix://` URLs, password included."""
    options = _client_options(socket_timeout_s)
    return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **options)


def connect_async(url: str, socket_timeout_s: float) -> redis.asyncio.Redis:
    """The asyncio client for the same URL and options (its connections belong to the event
    loop that first uses them), with at most MAX_ASYNC_CONNECTIONS: each request awaiting a
    lookup holds one, so a burst of requests would otherwise open as many; beyond it they
    wait for a free one."""
    from redis.asyncio.retry import Retry as AsyncRetry

    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_ASYNC_CONNECTIONS,
        timeout=None,
        retry=AsyncRetry(NoBackoff(), 0),
        **_client_options(socket_timeout_s),
    )
    return redis.asyncio.Redis(connection_pool=pool)


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
        self._url, self._socket_timeout_s = url, socket_timeout_s
        # The asyncio client of the loop that last called `acall` (one loop: the router's).
        self._async: tuple[asyncio.AbstractEventLoop, redis.asyncio.Redis] | None = None
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
        if self._backing_off():
            return default
        try:
            result = fn(self.client)
        except (redis.RedisError, OSError) as exc:
            # Besides connection errors, a refused command (OOM, READONLY replica, auth) also
            # counts as an outage: the index cannot work, and backing off avoids a log flood.
            self._mark_down(exc)
            return default
        self._answered()
        return result

    async def acall(self, fn: Callable[[redis.asyncio.Redis], Awaitable[T]], default: T) -> T:
        """`await fn(client)` with this loop's asyncio client, or `default` as `call` gives it."""
        if self._backing_off():
            return default
        try:
            result = await fn(self.async_client())
        except (redis.RedisError, OSError) as exc:  # asyncio's TimeoutError is an OSError
            self._mark_down(exc)
            return default
        self._answered()
        return result

    def async_client(self) -> redis.asyncio.Redis:
        """The asyncio client of the running event loop, made on its first use there."""
        loop = asyncio.get_running_loop()
        if self._async is None or self._async[0] is not loop:
            self._async = (loop, connect_async(self._url, self._socket_timeout_s))
        return self._async[1]

    async def aclose(self) -> None:
        """Closes the running loop's asyncio client, if it made one."""
        if self._async is not None and self._async[0] is asyncio.get_running_loop():
            await self._async[1].aclose()
            self._async = None

    def ping(self) -> bool:
        """True when Redis answers now (respects the backoff)."""
        return bool(self.call(lambda client: client.ping(), False))

    def close(self) -> None:
        self.client.close()

    def _backing_off(self) -> bool:
        """Down, and the next try is not due: do not spend a socket timeout."""
        return self._down and self._clock() < self._retry_at

    def _answered(self) -> None:
        if self._down:
            self._mark_up()
        else:
            self._gauge.set(1)  # cheap; keeps the gauge right with several links in a process

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
