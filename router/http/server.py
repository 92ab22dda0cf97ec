"""Runs the OpenAI HTTP API (router/http/api.py) with uvicorn on the router's event loop, over
TLS when the gRPC API has it (same certificate, same client CA), with deadlines and a cap on
its connections (router/http/connections.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from pdserve.tls_files import CertificateFiles
from router.http.connections import AcceptErrorLog, ConnectionLimits, guarded_protocol

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The process's signals belong to its owner (`pdserve serve` drains on SIGTERM), not
        # to uvicorn, which would take SIGINT/SIGTERM over and raise them again on exit.
        yield


class HttpServer:
    """`await start()` binds and serves (port 0 = any free port; `port` is the bound one);
    `await stop(grace_s)` stops taking connections and gives running requests up to
    `grace_s` before cancelling them."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        *,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
        limits: ConnectionLimits = ConnectionLimits(),
    ) -> None:
        self.host = host
        self.port = port
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan="off",
            # httptools (C) parses and frames HTTP for less CPU per stream event than h11;
            # guarded: idle and request deadlines, a connection cap.
            http=guarded_protocol(limits),
            timeout_keep_alive=limits.idle_timeout_s,
            log_config=None,  # the process's logging setup applies
            access_log=False,
            server_header=False,
            # The gRPC API's TLS settings (router/tls.py): HTTPS, mutual with a client CA.
            ssl_certfile=tls_cert,
            ssl_keyfile=tls_key,
            ssl_ca_certs=tls_client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca else ssl.CERT_NONE,
        )
        config.load()  # reads the TLS files now: a bad one fails the start, not a connection
        if tls_cert:  # renewed in place: served from the next handshake on
            files = CertificateFiles(tls_cert, tls_key, tls_client_ca, what="HTTP API")
            files.reload_at_handshakes(config.ssl)
        self._server = _Server(config)
        self._task: asyncio.Task | None = None
        self._accept_errors: AcceptErrorLog | None = None

    async def start(self) -> None:
        """Raises OSError when the address cannot be bound."""
        # Bound here, not by uvicorn, which exits the process when it cannot bind.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on connections
        # of such a socket. With Nagle on, a kept-alive connection holds each small stream
        # event until the client's delayed ACK, up to 40 ms: tokens arrive in bursts.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        self._accept_errors = AcceptErrorLog(asyncio.get_running_loop())
        self._accept_errors.install()
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            await self._task  # raises why it stopped
            raise RuntimeError(f"the HTTP server on port {self.port} stopped at once")
        log.info("router serving the OpenAI HTTP API on port %d", self.port)

    async def stop(self, grace_s: float = 30.0) -> None:
        if self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        await self._task
        self._task = None
        if self._accept_errors is not None:
            self._accept_errors.uninstall()
