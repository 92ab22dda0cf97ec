"""The one place where router exceptions become gRPC status codes and messages."""

from __future__ import annotations

import grpc

from router.types import NoWorkerAvailable, Overloaded
from router.validation import RequestError


class Unauthenticated(Exception):
    """Missing or wrong API key."""


_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (RequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoWorkerAvailable, grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Maps an exception to (status, message); anything unexpected is INTERNAL."""
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
