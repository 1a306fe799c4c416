"""Liveness probes, open to every caller: ``GET /healthz`` (JSON) and ``GET /health``,
``GET /v1/health`` (vLLM's probe: an empty 200).

Each runs ``SELECT 1`` on the database. When the database does not answer, the error handlers
(:mod:`app.api.errors`) answer 503 with ``{"error": ...}``, the same on all three paths. LLM
benchmark clients (guidellm, aiperf) and load balancers set up for vLLM or SGLang probe
``/health`` before sending any request; vLLM answers it with status 200 and an empty body.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel
from sqlalchemy import text

from app.api.deps import get_services
from app.services import Services

router = APIRouter(tags=["health"])


class Health(BaseModel):
    """``GET /healthz``: ``status`` is ``ok``; ``database`` the SQLAlchemy dialect that answered
    (``sqlite`` or ``postgresql``)."""

    status: str
    database: str


def _check_database(services: Services) -> None:
    """Run ``SELECT 1``; raises the database's error (503 through :mod:`app.api.errors`)."""
    with services.engine.connect() as conn:
        conn.execute(text("SELECT 1"))


@router.get("/healthz", response_model=Health)
def healthz(services: Services = Depends(get_services)) -> Health:
    """Liveness: 200 with ``{"status": "ok", "database": dialect}`` when the database answers."""
    _check_database(services)
    return Health(status="ok", database=services.engine.dialect.name)


# vLLM's answer has no body; ours says text/plain so the schema and the response name one type.
EMPTY_200: dict[int | str, dict[str, Any]] = {200: {
    "description": "healthy: an empty body",
    "content": {"text/plain": {"schema": {"type": "string", "maxLength": 0}}}}}


@router.get("/health", response_class=Response, responses=EMPTY_200)
@router.get("/v1/health", response_class=Response, responses=EMPTY_200)
def health(services: Services = Depends(get_services)) -> Response:
    """vLLM's liveness probe: 200 with an empty body when the database answers (else 503, as
    ``/healthz``)."""
    _check_database(services)
    return Response(status_code=200, media_type="text/plain")  # typed, as documented; no body
