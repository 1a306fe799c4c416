"""Security headers on every response: framing refused, no sniffing, a Content-Security-Policy.

:class:`SecurityHeadersMiddleware` adds :data:`DEFAULT_HEADERS` to every HTTP response
that does not set them itself: the REST API's JSON, ``/metrics``, static files and
error pages. Pages set their own, stricter or wider, policy and keep it: the console
(:data:`app.ui.web.SECURITY_HEADERS`: scripts and styles from ``/ui/static`` only) and
the API docs (:mod:`app.api.docs_pages`: local Swagger UI and ReDoc assets, the one
inline start-up script allowed by its hash).

The default policy (OWASP REST Security and HTTP Headers cheat sheets) lets a response
load nothing and be framed by no one: ``default-src 'none'; frame-ancestors 'none'``,
with ``X-Frame-Options: DENY`` for browsers older than CSP level 2,
``X-Content-Type-Options: nosniff`` and ``Referrer-Policy: same-origin``.
"""

from __future__ import annotations

from typing import Any

DEFAULT_CSP = "default-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
DEFAULT_HEADERS: dict[str, str] = {
    "Content-Security-Policy": DEFAULT_CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
_ENCODED = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in DEFAULT_HEADERS.items()]


class SecurityHeadersMiddleware:
    """ASGI middleware adding each of :data:`DEFAULT_HEADERS` a response does not already carry.

    Headers are added to the ``http.response.start`` message, so streamed answers (SSE)
    pass through unbuffered.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                present = {k.lower() for k, _v in headers}
                headers += [(k, v) for k, v in _ENCODED if k not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
