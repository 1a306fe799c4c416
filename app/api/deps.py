"""FastAPI dependencies: the services container and role checks."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import Depends, Request

from app.api.clock import record_auth_ms
from app.auth import ANONYMOUS_ADMIN, Principal, authenticate, require
from app.services import Services


def get_services(request: Request) -> Services:
    """The process-wide :class:`Services` held by the app."""
    return request.app.state.services  # type: ignore[no-any-return]


def _presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def get_principal(request: Request, services: Services = Depends(get_services)) -> Principal:
    """The caller's principal; everyone is admin when auth is disabled.

    The key check's duration is recorded on the request (``auth_ms``, :mod:`app.api.clock`),
    so an answer reports it apart inside its TTFT.

    Raises:
        Unauthenticated: (401) missing or unknown key.
    """
    if not services.settings.auth_enabled:
        return ANONYMOUS_ADMIN
    t0 = time.perf_counter()
    try:
        return authenticate(services.engine, _presented_key(request))
    finally:
        record_auth_ms(request, (time.perf_counter() - t0) * 1000.0)


def require_role(role: str) -> Callable[..., Principal]:
    """Dependency factory: the caller must hold ``role`` or above (401 / 403 otherwise)."""

    def _dep(principal: Principal = Depends(get_principal)) -> Principal:
        require(principal, role)
        return principal

    _dep.required_role = role  # type: ignore[attr-defined]
    return _dep
