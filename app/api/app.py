"""The FastAPI application factory.

Routers live one per resource in ``app.api.routes_*`` and each exposes
``router``, listed in :data:`ROUTERS`; every ``/v1`` route declares its role
with ``require_role``. On start (the app's lifespan: ``ragbudget serve``, each worker
of a server) the answers a killed process left unrecorded become ``interrupted``
receipts (:func:`app.answering.receipt_wiring.record_interrupted_answers`).

Middleware, outermost first: the arrival clock (:mod:`app.api.clock`), forwarded
headers from trusted proxies (:mod:`app.api.proxy`, only when ``trusted_proxies`` is
set), the security headers of every response (:mod:`app.api.security_headers`) and
the body limit (:mod:`app.api.limits`). ``/docs`` and ``/redoc`` load local assets
only (:mod:`app.api.docs_pages`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

from app.answering.pipeline import AnswerPipeline
from app.answering.receipt_wiring import record_interrupted_answers
from app.api import (
    routes_answer,
    routes_chat,
    routes_completions,
    routes_documents,
    routes_engines,
    routes_health,
    routes_keys,
    routes_latency,
    routes_metrics,
    routes_models,
    routes_receipts,
    routes_retrieval,
)
from app.api.clock import ArrivalClockMiddleware
from app.api.docs_pages import register_docs
from app.api.errors import ERROR_RESPONSES, install_error_handlers
from app.api.limits import BodyLimitMiddleware
from app.api.proxy import TrustedProxyMiddleware
from app.api.security_headers import SecurityHeadersMiddleware
from app.services import Services
from app.settings import Settings, get_settings
from app.ui import register as register_console

log = logging.getLogger("ragbudget")

# Every router, registered explicitly: a missing module is an ImportError at start, never
# a silently absent endpoint.
ROUTERS: tuple[APIRouter, ...] = (
    routes_engines.router,
    routes_health.router,
    routes_documents.router,
    routes_retrieval.router,
    routes_latency.router,
    routes_answer.router,
    routes_chat.router,
    routes_completions.router,
    routes_models.router,
    routes_receipts.router,
    routes_keys.router,
    routes_metrics.router,
)


def create_app(settings: Settings | None = None, services: Services | None = None) -> FastAPI:
    """Build the app around one :class:`Services` (created from ``settings`` if not given)."""
    services = services or Services(settings or get_settings())

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        drainer = _app.state.pipeline.receipts.drainer  # spooled receipts first, then the sweep
        await asyncio.to_thread(record_interrupted_answers, services, drainer)
        yield
        drainer.stop()
        _app.state.pipeline.close()  # the engines' /slots readers and health probes

    # docs_url/redoc_url off: FastAPI's pages load their scripts from a CDN; ours are local.
    app = FastAPI(title="ragbudget", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="RAG context-budget advisor with retrieval receipts.")
    app.state.services = services
    app.state.pipeline = AnswerPipeline(services)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=services.settings.max_body_bytes)
    app.add_middleware(SecurityHeadersMiddleware)
    if services.settings.trusted_proxy_list:  # before anything reads the client, scheme or host
        app.add_middleware(TrustedProxyMiddleware, trusted=services.settings.trusted_proxy_list)
    # Added last, so outermost: the request's one clock starts before anything else of ours runs.
    app.add_middleware(ArrivalClockMiddleware)
    for router in ROUTERS:
        app.include_router(router, responses=ERROR_RESPONSES)
    register_console(app)
    register_docs(app)
    if not services.settings.auth_enabled:
        log.warning("authentication is DISABLED (RAGBUDGET_AUTH_ENABLED=false): every caller is admin")
    return app
