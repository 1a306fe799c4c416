"""The FastAPI application factory.

Routers live one per resource in ``app.api.routes_*`` and each exposes
``router``; every ``/v1`` route declares its role with ``require_role``.
"""

from __future__ import annotations

import importlib
import logging

from fastapi import FastAPI

from app.api.errors import ERROR_RESPONSES, install_error_handlers
from app.api.limits import BodyLimitMiddleware
from app.pipeline import AnswerPipeline
from app.services import Services
from app.settings import Settings, get_settings

log = logging.getLogger("ragbudget")

ROUTER_MODULES = [
    "app.api.routes_health",
    "app.api.routes_documents",
    "app.api.routes_retrieval",
    "app.api.routes_latency",
    "app.api.routes_answer",
    "app.api.routes_chat",
    "app.api.routes_receipts",
    "app.api.routes_keys",
    "app.api.routes_metrics",
]


def create_app(settings: Settings | None = None, services: Services | None = None) -> FastAPI:
    """Build the app around one :class:`Services` (created from ``settings`` if not given)."""
    services = services or Services(settings or get_settings())
    app = FastAPI(title="ragbudget", version="0.1.0",
                  description="RAG context-budget advisor with retrieval receipts.")
    app.state.services = services
    app.state.pipeline = AnswerPipeline(services)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=services.settings.max_body_bytes)
    for name in ROUTER_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        app.include_router(module.router, responses=ERROR_RESPONSES)
    if not services.settings.auth_enabled:
        log.warning("authentication is DISABLED (RAGBUDGET_AUTH_ENABLED=false): every caller is admin")
    return app
