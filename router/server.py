"""Assembles the router's grpc.aio server: Generation, standard health, server reflection."""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.pb import generate_pb2, generate_pb2_grpc
from router.generation_service import GenerationService

log = logging.getLogger(__name__)

GENERATION_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class RouterServer:
    """The client-facing server.

    Health: the overall service "" is SERVING while the process runs (a liveness probe must
    not restart the router, and every worker actor with it, because workers are down);
    "pdserve.v1.Generation" is SERVING only while a decode worker can take requests
    (readiness).
    """

    def __init__(
        self, service: GenerationService, host: str, port: int, interceptors: list | None = None
    ) -> None:
        self.service = service
        self._server = grpc.aio.server(
            interceptors=interceptors or [],
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
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
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise RuntimeError(f"could not bind the router to {host}:{port}")

    async def start(self) -> None:
        await self._server.start()
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

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
