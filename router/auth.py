"""API-key authentication of the client API, in one place: a grpc.aio server interceptor.

With keys configured, every RPC (Generation, reflection) must carry `authorization: Bearer
<key>`; the scheme is case-insensitive, as HTTP's is. Health stays open for probes.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

import grpc

from pdserve.grpc_handlers import rewrap
from router.errors import Unauthenticated, status_for

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
_REFUSAL = status_for(
    Unauthenticated("missing or invalid API key (metadata 'authorization: Bearer <key>')")
)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses RPCs without a valid key with UNAUTHENTICATED; no keys = authentication off."""

    def __init__(self, api_keys: Iterable[str] = ()) -> None:
        self.api_keys = list(api_keys)

    @property
    def api_keys(self) -> list[str]:
        return [key.decode() for key in self._keys]

    @api_keys.setter
    def api_keys(self, keys: Iterable[str]) -> None:
        self._keys = [key.encode() for key in keys]

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if (
            handler is None
            or not self._keys
            or details.method.startswith(OPEN_METHOD_PREFIXES)
            or self.authorized(details.invocation_metadata or ())
        ):
            return handler
        # The request is never decoded: an unauthenticated caller costs no parsing.
        return rewrap(handler, _refuse, raw_requests=True)

    def authorized(self, metadata: Iterable[tuple[str, Any]]) -> bool:
        """Whether `metadata` (lower-case keys) carries a valid `authorization: Bearer` key."""
        value = next((v for k, v in metadata if k == "authorization"), "")
        if not isinstance(value, str):
            return False
        scheme, _, key = value.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = key.strip().encode()
        # Every key is compared, so the time taken does not tell which one nearly matched.
        return sum(hmac.compare_digest(given, k) for k in self._keys) > 0


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(*_REFUSAL)
