"""Bounds on the HTTP port's connections, which uvicorn does not set itself.

uvicorn closes a kept-alive connection idle after a response, but not one that never sends a
request, nor one that sends its headers or body a byte at a time; and it accepts connections
until the process runs out of file descriptors. `guarded_protocol` is uvicorn's httptools
protocol with, per connection:

- an idle deadline from the moment it opens (uvicorn's keep-alive timeout, armed at once);
- a request deadline: the request's headers and body must have arrived within
  `request_timeout_s` of its first byte, or the connection is answered 408 and closed;
- a cap: beyond `max_connections` open ones, a new connection is answered 503 and closed.

`AcceptErrorLog` keeps the loop's accept errors (EMFILE...) to one line per interval.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.http.errors import error_body

log = logging.getLogger(__name__)

# The HTTP port may hold half of the process's file descriptors; gRPC, Ray, Redis and files
# share the rest.
_FD_SHARE = 0.5
_MAX_CONNECTIONS = 10_000


def default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _MAX_CONNECTIONS
    return max(16, min(_MAX_CONNECTIONS, int(soft * _FD_SHARE)))


@dataclass(frozen=True)
class ConnectionLimits:
    idle_timeout_s: float = 5.0  # open without a request in progress (uvicorn's keep-alive)
    request_timeout_s: float = 30.0  # a request's headers and body, from its first byte
    max_connections: int = 0  # 0 = default_max_connections()


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps(error_body(status, message)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def guarded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    max_connections = limits.max_connections or default_max_connections()
    too_many = _raw_response(
        503, "Service Unavailable", f"connections: more than {max_connections} open; retry later"
    )
    too_slow = _raw_response(
        408,
        "Request Timeout",
        f"request: headers and body not received within {limits.request_timeout_s:g} s",
    )

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _request_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(too_many)
                transport.close()
                return
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._end_request_deadline()
            self._request_deadline = self.loop.call_later(
                limits.request_timeout_s, self._request_too_slow
            )

        def on_message_complete(self) -> None:
            self._end_request_deadline()
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._end_request_deadline()
            super().connection_lost(exc)

        def _end_request_deadline(self) -> None:
            if self._request_deadline is not None:
                self._request_deadline.cancel()
                self._request_deadline = None

        def _request_too_slow(self) -> None:
            self._request_deadline = None
            if self.transport.is_closing():
                return
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(too_slow)
            self.transport.close()

    return GuardedHttpToolsProtocol


class AcceptErrorLog:
    """A loop exception handler: accept errors (out of file descriptors, memory) as one
    WARNING line per `interval_s` with the count, not a traceback each; everything else goes
    to the handler that was there before."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._loop = loop
        self._previous = loop.get_exception_handler()
        self._last_logged = -float("inf")
        self._suppressed = 0

    def install(self) -> None:
        self._loop.set_exception_handler(self)

    def uninstall(self) -> None:
        if self._loop.get_exception_handler() is self:
            self._loop.set_exception_handler(self._previous)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not str(context.get("message", "")).startswith("socket.accept()"):
            if self._previous is not None:
                self._previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self._last_logged < self.interval_s:
            self._suppressed += 1
            return
        log.warning(
            "%s: %s (%d more since the last such line)",
            context["message"],
            context.get("exception"),
            self._suppressed,
        )
        self._last_logged, self._suppressed = now, 0
