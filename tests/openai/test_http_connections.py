"""The HTTP port's connection bounds, on a real uvicorn server: thousands of idle and
slowloris connections leave real requests' latency alone, slow and idle ones are closed at
their deadlines, connections past the cap are refused with 503, accept errors are one log line
per interval."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.models.tokenizer_builder import write_tokenizer
from pdserve.tokenizer import Tokenizer
from router.auth import ApiKeyInterceptor
from router.http.api import create_app
from router.http.connections import AcceptErrorLog, ConnectionLimits
from router.http.server import HttpServer
from router.http.service import OpenAIService
from router.tokenizing import BackgroundTokenizer
from router.validation import ModelLimits

IDLE = 5000
SLOWLORIS = 500
STALL_MARGIN_S = 0.025
SAMPLES = 300
SLOW_PREFIX = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


class Served:
    """The HTTP API (no workers behind it: /v1/models is the real request) on its own loop in
    a thread, as the router runs it."""

    def __init__(self, directory: Path, limits: ConnectionLimits) -> None:
        write_tokenizer(directory, 512)
        service = OpenAIService(
            None,
            BackgroundTokenizer(Tokenizer.from_dir(directory)),
            ModelLimits("tiny", 512, 256, [1]),
        )
        self.server = HttpServer(
            create_app(service, ApiKeyInterceptor(())), "127.0.0.1", 0, limits=limits
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        self.address = ("127.0.0.1", self.server.port)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(1), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def more_fds() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Both ends of each connection are in this process, and the server's default cap is half
    # the limit: two per connection, with room.
    wanted = 2 * (IDLE + SLOWLORIS) + 1024
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {wanted}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def p99_latency_s(url: str) -> float:
    with httpx.Client() as client:
        times = []
        for _ in range(SAMPLES):
            started = time.perf_counter()
            assert client.get(url, timeout=10).status_code == 200
            times.append(time.perf_counter() - started)
    return sorted(times)[int(0.99 * SAMPLES) - 1]


def connect(address) -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    return sock


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` within `within_s` (whatever it answers first)."""
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass  # reset: closed
    return True


def test_idle_and_slowloris_connections_neither_slow_requests_nor_stay(tmp_path, more_fds):
    served = Served(tmp_path, ConnectionLimits(idle_timeout_s=60, request_timeout_s=4))
    url = f"http://127.0.0.1:{served.server.port}/v1/models"
    sockets: list[socket.socket] = []
    try:
        idle_p99 = p99_latency_s(url)
        sockets += [connect(served.address) for _ in range(IDLE)]
        slow = [connect(served.address) for _ in range(SLOWLORIS)]
        sockets += slow
        slow_started = time.monotonic()
        for sock in slow:
            sock.sendall(SLOW_PREFIX)
        stop = threading.Event()

        def trickle() -> None:  # a header byte per connection every 100 ms
            while not stop.wait(0.1):
                for sock in slow:
                    with contextlib.suppress(OSError):  # cut off: the deadline passed
                        sock.send(b"x")

        trickler = threading.Thread(target=trickle)
        trickler.start()
        try:
            loaded_p99 = p99_latency_s(url)
            assert time.monotonic() - slow_started < 4, "measured after the slow ones were cut"
        finally:
            stop.set()
            trickler.join()
        print(f"p99 idle {idle_p99 * 1e3:.2f} ms, with {IDLE}+{SLOWLORIS}: {loaded_p99 * 1e3:.2f}")
        # Not stalled: a server that waited on the trickling connections would add a trickle
        # period (100 ms) or their deadline (4 s). The 25 ms beyond twice the idle p99 is a
        # loaded 2-core CI machine's scheduling (one CI run: 1.1 ms idle, 5.1 ms loaded).
        assert loaded_p99 <= 2 * idle_p99 + STALL_MARGIN_S, (idle_p99, loaded_p99)
        # Each slowloris connection is answered 408 and closed at its 4 s deadline.
        assert all(
            closed_by_server(sock, 4 + 10 - (time.monotonic() - slow_started)) for sock in slow
        )
        assert time.monotonic() - slow_started < 4 + 10
        # The idle ones (60 s deadline) are still open.
        assert not closed_by_server(sockets[0], 0.1)
    finally:
        for sock in sockets:
            sock.close()
        served.close()


def test_a_connection_that_never_sends_is_closed_at_the_idle_deadline(tmp_path):
    served = Served(tmp_path, ConnectionLimits(idle_timeout_s=1, request_timeout_s=30))
    try:
        with connect(served.address) as sock:
            started = time.monotonic()
            assert closed_by_server(sock, 10)
            assert 0.9 <= time.monotonic() - started < 5
    finally:
        served.close()


def test_connections_past_the_cap_are_refused_with_503(tmp_path):
    served = Served(tmp_path, ConnectionLimits(max_connections=20))
    held = [connect(served.address) for _ in range(20)]
    try:
        time.sleep(0.5)  # all accepted
        with connect(served.address) as extra:
            extra.settimeout(10)
            answer = extra.recv(65536)
            assert answer.startswith(b"HTTP/1.1 503 ") and b"connections" in answer
            assert closed_by_server(extra, 10)
        held.pop().close()
        time.sleep(0.5)
        with httpx.Client() as client:
            url = f"http://127.0.0.1:{served.server.port}/health"
            assert client.get(url, timeout=10).status_code == 200
    finally:
        for sock in held:
            sock.close()
        served.close()


def test_accept_errors_are_one_line_per_interval(caplog):
    async def main() -> None:
        loop = asyncio.get_running_loop()
        errors = AcceptErrorLog(loop, interval_s=60)
        errors.install()
        try:
            for _ in range(1000):
                loop.call_exception_handler(
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": OSError(errno.EMFILE, "Too many open files"),
                    }
                )
        finally:
            errors.uninstall()

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    lines = [r for r in caplog.records if "socket.accept()" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
