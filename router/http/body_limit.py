"""A cap on HTTP request bodies, checked before they are read: the HTTP twin of the gRPC
server's receive limit, so an oversized request costs the router nothing."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from router.http.errors import error_body

Scope = dict[str, Any]


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` (by Content-Length, or counted as it arrives
    when chunked) is answered 413 in OpenAI's error form."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        received, exceeded = 0, False

        async def counted_receive() -> dict:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message: dict) -> None:
            if not exceeded:  # else the app's answer to a body it could not read: dropped
                await send(message)

        with contextlib.suppress(BodyTooLarge):
            await self.app(scope, counted_receive, guarded_send)
        if exceeded:
            await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        message = f"body: larger than the limit of {self.max_bytes} bytes"
        body = json.dumps(error_body(413, message)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),  # the rest of the body is not read: the client may stop
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
