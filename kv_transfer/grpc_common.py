"""gRPC plumbing shared by both transports' control plane: secret, options, auth, status codes."""

from __future__ import annotations

import hmac
import os
import socket
from collections.abc import Callable
from typing import Any

import grpc

from kv_transfer.reservations import RejectReason
from pdserve.config import KVTransferConfig

SECRET_METADATA_KEY = "x-pdserve-kv-secret"
SERVICE = "pdserve.v1.KVTransfer"

# KV chunks are megabytes: lift gRPC's 4 MiB receive cap, and keep compression off (KV
# activations barely compress and it would cost more CPU than the wire saves).
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.default_compression_algorithm", 0),
]

STATUS_OF: dict[RejectReason, grpc.StatusCode] = {
    RejectReason.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    RejectReason.NOT_OPEN: grpc.StatusCode.FAILED_PRECONDITION,
    RejectReason.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    RejectReason.CORRUPT: grpc.StatusCode.DATA_LOSS,
    RejectReason.INCOMPLETE: grpc.StatusCode.FAILED_PRECONDITION,
    RejectReason.COMMIT_FAILED: grpc.StatusCode.FAILED_PRECONDITION,
}


def resolve_secret(config: KVTransferConfig) -> str:
    """The shared secret: config.secret, else env PDSERVE_KV_SECRET. Both sides must agree, so
    there is no per-process default; `pdserve serve` generates one and hands it to every worker."""
    secret = config.secret or os.environ.get("PDSERVE_KV_SECRET")
    if not secret:
        raise ValueError(
            "KV transfer needs a shared secret: set KVTransferConfig.secret or PDSERVE_KV_SECRET"
        )
    return secret


def bind_host(config: KVTransferConfig) -> str:
    """Where the KV endpoint listens: bind_host, else only the address peers dial."""
    return config.bind_host or advertise_host(config)


def advertise_host(config: KVTransferConfig) -> str:
    """The host peers dial: advertise_host, else a specific bind_host, else this node's IP."""
    if config.advertise_host:
        return config.advertise_host
    if config.bind_host not in (None, "0.0.0.0", "::", ""):
        return config.bind_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:  # no packet is sent: connect() on UDP only picks the outgoing interface
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class SecretInterceptor(grpc.ServerInterceptor):
    """Answers UNAUTHENTICATED unless the call carries the shared secret (constant-time compare)."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    def intercept_service(
        self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(details)
        given = dict(details.invocation_metadata or ()).get(SECRET_METADATA_KEY, "")
        if handler is None or hmac.compare_digest(str(given).encode(), self._secret):
            return handler

        def deny(_request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong KV-transfer secret")

        # Same arity as the real method, but no deserializer: a denied stream is never parsed.
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def rpc_error_text(endpoint: str, error: grpc.RpcError) -> str:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    return f"KV endpoint {endpoint}: {code.name if code else 'error'}: {details}"
