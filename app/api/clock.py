"""One clock per request: the arrival time stamped at the earliest point the app sees it.

:class:`ArrivalClockMiddleware` is the outermost user middleware (added last in
:func:`app.api.app.create_app`), so only Starlette's own error wrapper and the
server's HTTP parsing run before it. It stores ``time.perf_counter()`` (seconds,
monotonic) in the request's ASGI state as ``arrival_t``; every later step (body
limit, body parsing, validation, authentication, queue wait, retrieval,
planning, prefill) falls inside an answer's measured and planned TTFT, which the
pipeline counts from that stamp. :func:`get_principal <app.api.deps.get_principal>`
adds ``auth_ms``, the time the key check took, so answers report it apart.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request

ARRIVAL_KEY = "arrival_t"
AUTH_KEY = "auth_ms"


class ArrivalClockMiddleware:
    """ASGI middleware stamping ``scope["state"]["arrival_t"]`` (``perf_counter`` seconds)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[ARRIVAL_KEY] = time.perf_counter()
        await self.app(scope, receive, send)


def arrival_of(request: Request) -> float:
    """The request's arrival stamp (``perf_counter`` seconds); now when no middleware stamped it."""
    t = request.scope.get("state", {}).get(ARRIVAL_KEY)
    return float(t) if t is not None else time.perf_counter()


def auth_ms_of(request: Request) -> float | None:
    """Time the key check of this request took, ms; ``None`` when none ran (auth off)."""
    v = request.scope.get("state", {}).get(AUTH_KEY)
    return float(v) if v is not None else None


def record_auth_ms(request: Request, ms: float) -> None:
    """Record the key check's duration (ms) on the request."""
    request.scope.setdefault("state", {})[AUTH_KEY] = ms
