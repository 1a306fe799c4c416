"""Request body size limit (HTTP 413 ``body_too_large``), enforced before the body is parsed.

Checks ``Content-Length`` up front and counts streamed (chunked) bodies as they
arrive, so an oversized upload is refused without being buffered whole.
"""

from __future__ import annotations

import json
from typing import Any

from app.api.errors import error_body

Scope = dict[str, Any]


class BodyLimitMiddleware:
    """ASGI middleware refusing request bodies larger than ``max_bytes``."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                too_big = False
            if too_big:
                await self._reject(send)
                return
        seen = 0
        rejected = False
        started = replaced = False

        async def counting_receive() -> Any:
            nonlocal seen, rejected
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    rejected = True
                    raise _TooLarge()
            return message

        async def guarded_send(message: Any) -> None:
            # The framework may catch _TooLarge while parsing the body and answer 400 itself;
            # once the body was refused, that response is replaced by the 413.
            nonlocal started, replaced
            if rejected and not started:
                started = replaced = True
                await self._reject(send)
                return
            if replaced:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _TooLarge:
            if not started:
                await self._reject(send)

    async def _reject(self, send: Any) -> None:
        body = json.dumps(error_body("body_too_large",
                                     f"request body exceeds {self.max_bytes} bytes",
                                     {"limit": self.max_bytes})).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
