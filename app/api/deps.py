"""FastAPI dependencies: the services container and role checks."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Depends, Request

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

    Raises:
        Unauthenticated: (401) missing or unknown key.
    """
    if not services.settings.auth_enabled:
        return ANONYMOUS_ADMIN
    return authenticate(services.engine, _presented_key(request))


def require_role(role: str) -> Callable[..., Principal]:
    """Dependency factory: the caller must hold ``role`` or above (401 / 403 otherwise)."""

    def _dep(principal: Principal = Depends(get_principal)) -> Principal:
        require(principal, role)
        return principal

    _dep.required_role = role  # type: ignore[attr-defined]
    return _dep
