"""``GET /healthz``: open liveness and database check."""

from __future__ import annotations

from fastapi import APIRouter, Depends
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


@router.get("/healthz", response_model=Health)
def healthz(services: Services = Depends(get_services)) -> Health:
    """Liveness: 200 with ``{"status": "ok", "database": dialect}`` when the database answers."""
    with services.engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    return Health(status="ok", database=services.engine.dialect.name)
