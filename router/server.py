"""Assembles the router's grpc.aio server: Generation, standard health, server reflection."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.pb import generate_pb2, generate_pb2_grpc
from router.auth import ApiKeyInterceptor
from router.generation_service import GenerationService
from router.request_decoding import RequestDecodingInterceptor

log = logging.getLogger(__name__)

GENERATION_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
DEFAULT_SHUTDOWN_GRACE_S = 30.0
# A Tokenize response of a prompt at the byte cap is several times the prompt's size.
_MAX_SEND_BYTES = 64 << 20
# Connection bounds, as on the HTTP port (router/http/connections.py): a connection must finish
# its TLS/HTTP/2 handshake within the first, is closed once idle (no RPC) for the second, and
# carries at most the third RPCs at once (more wait for the client's HTTP/2 flow control).
GRPC_HANDSHAKE_TIMEOUT_MS = 10_000
GRPC_MAX_CONNECTION_IDLE_MS = 300_000
GRPC_MAX_CONCURRENT_STREAMS = 256


class RouterServer:
    """The client-facing server.

    Health: the overall service "" is SERVING while the process runs (a liveness probe must
    not restart the router, and every worker actor with it, because workers are down);
    "pdserve.v1.Generation" is SERVING only while a decode worker can take requests
    (readiness). API keys are checked by `auth` on every RPC but health; with `credentials`
    the port speaks TLS (mutual TLS if they require client certificates), and `health_port`
    offers health alone in plaintext.
    """

    def __init__(
        self,
        service: GenerationService,
        host: str,
        port: int,
        *,
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
        api_keys: Iterable[str] = (),
        credentials: grpc.ServerCredentials | None = None,
        max_receive_bytes: int = 64 << 20,
        shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
        health_port: int | None = None,
        handshake_timeout_ms: int = GRPC_HANDSHAKE_TIMEOUT_MS,
        max_connection_idle_ms: int = GRPC_MAX_CONNECTION_IDLE_MS,
    ) -> None:
        self.service = service
        self.auth = ApiKeyInterceptor(api_keys)
        self.shutdown_grace_s = shutdown_grace_s
        self._server = grpc.aio.server(
            # Outermost first: refuse unauthenticated calls before decoding or tracing them.
            interceptors=[self.auth, RequestDecodingInterceptor(), *interceptors],
            options=[
                ("grpc.max_receive_message_length", max_receive_bytes),
                ("grpc.max_send_message_length", _MAX_SEND_BYTES),
                # A port another server listens on is an error, never silently shared.
                ("grpc.so_reuseport", 0),
                ("grpc.server_handshake_timeout_ms", handshake_timeout_ms),
                ("grpc.max_connection_idle_ms", max_connection_idle_ms),
                ("grpc.max_concurrent_streams", GRPC_MAX_CONCURRENT_STREAMS),
            ],
        )
        generate_pb2_grpc.add_GenerationServicer_to_server(service, self._server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            [
                GENERATION_SERVICE,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self._server,
        )
        address = f"{host}:{port}"
        if credentials is None:
            self.port = self._server.add_insecure_port(address)
        else:
            self.port = self._server.add_secure_port(address, credentials)
        if self.port == 0:
            raise RuntimeError(f"could not bind the router to {address}")
        self._health_server = None if health_port is None else self._plain_health(host, health_port)

    def _plain_health(self, host: str, port: int) -> grpc.aio.Server:
        """A plaintext port serving only grpc.health.v1, for probes that cannot speak TLS
        (the kubelet's); it shares the statuses of the main server."""
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.health_port = server.add_insecure_port(f"{host}:{port}")
        if self.health_port == 0:
            raise RuntimeError(f"could not bind the router's health port to {host}:{port}")
        return server

    async def start(self) -> None:
        await self._server.start()
        if self._health_server:
            await self._health_server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.set_ready(True)
        log.info("router serving pdserve.v1.Generation on port %d", self.port)

    async def set_ready(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set(GENERATION_SERVICE, status)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops taking RPCs at once (health turns NOT_SERVING), lets the running ones finish
        for up to `grace_s` (default: `shutdown_grace_s`), then cancels what is left."""
        grace = self.shutdown_grace_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        log.info("router draining: up to %.1f s for the running requests", grace)
        await self._server.stop(grace)
        if self._health_server:
            await self._health_server.stop(0)
        self.service.close()
