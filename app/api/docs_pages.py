"""The interactive API docs, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), with no third-party script.

FastAPI's own docs pages load Swagger UI and ReDoc from a CDN (jsDelivr), and ReDoc
its fonts from Google: the browser of an operator reading the docs would run code
from a third party and tell it who reads which server's docs. Here the assets are the
ones vendored by the PyPI package ``fastapi-offline`` (Swagger UI bundle and CSS,
ReDoc standalone, a favicon), served from ``/static-docs``; the pages are FastAPI's
own HTML (:func:`fastapi.openapi.docs.get_swagger_ui_html`, ``get_redoc_html`` without
Google fonts) pointed at them.

Each page's Content-Security-Policy (:func:`page_csp`) allows scripts from this
origin and, by its SHA-256 (CSP level 2 hash sources), only the inline start-up
script the page itself carries; styles from this origin and inline (both UIs set
element styles); images from this origin and ``data:``; ReDoc's search worker from
``blob:``; and no framing.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

DOCS_STATIC = Path(fastapi_offline.__file__).resolve().parent / "static"
STATIC_URL = "/static-docs"
# An inline script: a <script> element without a src attribute, and its exact text.
_INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>(.*?)</script>", re.DOTALL | re.IGNORECASE)


def page_csp(html: str) -> str:
    """The Content-Security-Policy of a docs page: scripts from ``'self'`` and, by hash, each
    inline script of ``html``."""
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
                      for s in _INLINE_SCRIPT.findall(html))
    script_src = f"'self' {hashes}".strip()
    return (f"default-src 'none'; script-src {script_src}; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; "
            "frame-ancestors 'none'; base-uri 'none'; form-action 'self'")


def _with_csp(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = page_csp(bytes(page.body).decode())
    return page


def register_docs(app: FastAPI) -> None:
    """Serve ``/docs``, its OAuth2 redirect page, ``/redoc`` and their assets under ``/static-docs``.

    ``app`` must be built with ``docs_url=None, redoc_url=None`` (FastAPI's CDN pages off).
    """
    openapi_url = app.openapi_url or "/openapi.json"
    redirect_url = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"
    app.mount(STATIC_URL, StaticFiles(directory=str(DOCS_STATIC)), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        """Swagger UI over this server's OpenAPI document, from local assets."""
        root = request.scope.get("root_path", "")
        return _with_csp(get_swagger_ui_html(
            openapi_url=f"{root}{openapi_url}", title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}{redirect_url}",
            swagger_js_url=f"{root}{STATIC_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{STATIC_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{STATIC_URL}/favicon.png",
            swagger_ui_parameters=app.swagger_ui_parameters))

    @app.get(redirect_url, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        """Swagger UI's OAuth2 redirect page."""
        return _with_csp(get_swagger_ui_oauth2_redirect_html())

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        """ReDoc over this server's OpenAPI document, from local assets, without Google fonts."""
        root = request.scope.get("root_path", "")
        return _with_csp(get_redoc_html(
            openapi_url=f"{root}{openapi_url}", title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{STATIC_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{STATIC_URL}/favicon.png", with_google_fonts=False))
