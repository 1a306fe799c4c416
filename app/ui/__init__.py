"""The operator console: server-rendered pages under ``/ui`` for the operator and admin roles.

Sign-in exchanges an API key for a session cookie (:mod:`app.ui.sessions`,
:mod:`app.ui.views_auth`); the pages show receipts and replay
(:mod:`app.ui.views_receipts`), the chunk-count vs TTFT curve
(:mod:`app.ui.views_tuning`) and the corpus (:mod:`app.ui.views_corpus`). Pages are
Jinja2 templates with a little plain JavaScript and server-side SVG charts; nothing
is built or fetched from elsewhere. Every page calls the same services as the REST
API. The app registers the console with :func:`register`.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from app.ui import views_auth, views_corpus, views_receipts, views_tuning
from app.ui.sessions import SessionStore
from app.ui.web import STATIC

ROUTERS = (views_auth.router, views_receipts.router, views_tuning.router, views_corpus.router)


def register(app: FastAPI) -> None:
    """Mount the console on ``app``: its routes, ``/ui/static`` and a session store sized by the
    settings (``ui_session_idle_s``, ``ui_session_max_s``). ``app.state.services`` must be set."""
    settings = app.state.services.settings
    app.state.console_sessions = SessionStore(settings.ui_session_idle_s, settings.ui_session_max_s)
    for router in ROUTERS:
        app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=str(STATIC)), name="ui-static")
