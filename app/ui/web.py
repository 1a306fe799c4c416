"""The console's web plumbing: templates, the route class, sign-in checks, forms and CSRF.

Every console route uses :class:`ConsoleRoute`, which

* renders errors as HTML pages (statuses from :func:`app.api.errors.status_for`, the
  one place HTTP statuses are mapped), and sends a browser that is not signed in to
  ``/ui/login`` (303);
* adds the security headers of every console response: a strict Content-Security-Policy
  (scripts and styles only from ``/ui/static``; inline ``style`` attributes allowed for
  the inline SVG charts), ``X-Frame-Options: DENY``, ``nosniff``, a ``same-origin`` referrer policy and
  ``Cache-Control: no-store`` (pages hold questions, answers and document text);
* adds ``Server-Timing: app;dur=<ms>``, the server time of the page.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from jinja2 import Environment, FileSystemLoader, Undefined, select_autoescape
from starlette.responses import HTMLResponse, RedirectResponse, Response

from app.api.errors import status_for
from app.auth import ANONYMOUS_ADMIN, Principal, active_principal
from app.services import Services
from app.ui.sessions import SESSION_COOKIE, ConsoleSession, SessionStore, tokens_equal
from foundation.errors import Forbidden, InvalidInput, RagBudgetError, Unauthenticated

TEMPLATES = Path(__file__).resolve().parent / "templates"
STATIC = Path(__file__).resolve().parent / "static"
MAX_FORM_BYTES = 64 * 1024
CONSOLE_ROLE = "operator"  # operator and admin may use the console; copilot keys are refused

SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; "
                                "base-uri 'none'; connect-src 'self'"),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" makes browsers send "Origin: null"
    "Cache-Control": "no-store",
}

_env = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=select_autoescape(default=True),
                   trim_blocks=True, lstrip_blocks=True)


def _missing(value: Any) -> bool:
    return value is None or isinstance(value, Undefined)


def _ms(value: Any, digits: int = 0) -> str:
    """A duration in ms for a page (``–`` when missing, e.g. a failed answer's TTFT)."""
    return "–" if _missing(value) else f"{float(value):,.{digits}f} ms"


def _num(value: Any, digits: int = 0) -> str:
    """A count for a page, with thousands separators (``–`` when missing)."""
    return "–" if _missing(value) else f"{float(value):,.{digits}f}"


_env.filters["ms"] = _ms
_env.filters["num"] = _num


class LoginRequired(Exception):
    """Raised by :func:`console_user` when the browser has no live session."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class ConsoleUser:
    """The signed-in caller of a console page: principal, session and cookie token."""

    principal: Principal
    session: ConsoleSession
    token: str

    @property
    def csrf_token(self) -> str:
        """The session's CSRF token, which every form of the console posts back."""
        return self.session.csrf_token


def get_services(request: Request) -> Services:
    """The app's :class:`Services` (the same object the REST API uses)."""
    return request.app.state.services  # type: ignore[no-any-return]


def get_store(request: Request) -> SessionStore:
    """The app's console :class:`SessionStore`."""
    return request.app.state.console_sessions  # type: ignore[no-any-return]


def console_user(request: Request, services: Services = Depends(get_services),
                 store: SessionStore = Depends(get_store)) -> ConsoleUser:
    """The signed-in operator or admin of this request.

    The key behind the session is re-read on every request: a revoked key ends the session.

    Raises:
        LoginRequired: no cookie, an unknown or expired session, or a revoked key.
        Forbidden: the key's role is below operator (cannot happen for sessions this
            console created, kept as a second line).
    """
    token = request.cookies.get(SESSION_COOKIE)
    session = store.get(token)
    if session is None or token is None:
        raise LoginRequired("expired" if token else "")
    if session.key_id == ANONYMOUS_ADMIN.id:
        if services.settings.auth_enabled:  # made while auth was off, then the server changed
            store.end(token)
            raise LoginRequired("expired")
        principal = ANONYMOUS_ADMIN
    else:
        try:
            principal = active_principal(services.engine, session.key_id)
        except Unauthenticated:
            store.end(token)
            raise LoginRequired("revoked") from None
    if not principal.allows(CONSOLE_ROLE):
        store.end(token)
        raise Forbidden("the console needs an operator or admin key", code="console_role",
                        required_role=CONSOLE_ROLE, role=principal.role)
    return ConsoleUser(principal, session, token)


async def form_fields(request: Request) -> dict[str, str]:
    """The fields of an ``application/x-www-form-urlencoded`` body (last value wins; ``{}`` when empty).

    Raises:
        InvalidInput: another content type, or a body over 64 KiB.
    """
    body = await request.body()
    if not body:
        return {}  # an empty form (its checks, e.g. CSRF, then refuse it)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        raise InvalidInput("console forms are application/x-www-form-urlencoded", code="invalid_form")
    if len(body) > MAX_FORM_BYTES:
        raise InvalidInput("form too large", code="invalid_form")
    parsed = parse_qs(body.decode("utf-8", errors="replace"), keep_blank_values=True)
    return {k: v[-1] for k, v in parsed.items()}


def check_origin(request: Request) -> None:
    """Refuse a cross-origin form post: ``Origin`` present and neither this server's own nor trusted.

    This server's own origin is the request's scheme and ``Host``, which behind a reverse
    proxy are what the browser used only when the proxy is trusted (``trusted_proxies``,
    :mod:`app.api.proxy`). Origins in ``trusted_origins`` are accepted as well
    (:func:`origin_trusted`). A browser that sends no ``Origin`` is left to the CSRF token.

    Raises:
        Forbidden (``csrf_failed``).
    """
    origin = request.headers.get("origin")
    if origin == "null":
        raise Forbidden("form from an opaque origin refused", code="csrf_failed")
    if origin:
        own = f"{request.url.scheme}://{request.headers.get('host', '')}".lower()
        origin = origin.rstrip("/").lower()
        trusted = get_services(request).settings.trusted_origin_list
        if origin != own and not origin_trusted(origin, trusted):
            raise Forbidden("cross-origin form refused (behind a reverse proxy: set "
                            "RAGBUDGET_TRUSTED_PROXIES or RAGBUDGET_TRUSTED_ORIGINS)", code="csrf_failed",
                            origin=origin, expected=own)


def origin_trusted(origin: str, trusted: list[str]) -> bool:
    """True when ``origin`` (lower case, no trailing slash) is one of ``trusted``; an entry
    ``scheme://*.example.com`` matches every subdomain of example.com on that scheme (and
    port), not example.com itself (Django's ``CSRF_TRUSTED_ORIGINS``)."""
    for entry in trusted:
        if origin == entry:
            return True
        scheme, _, host = entry.partition("://")
        if host.startswith("*.") and origin.startswith(scheme + "://"):
            suffix = host[1:]  # ".example.com[:port]"
            name = origin[len(scheme) + 3:]
            if name.endswith(suffix) and len(name) > len(suffix) and "/" not in name:
                return True
    return False


def check_csrf(request: Request, user: ConsoleUser, form: dict[str, str]) -> None:
    """A state-changing console form must carry its session's CSRF token and come from this origin.

    Raises:
        Forbidden (``csrf_failed``): missing or wrong token, or a cross-origin post.
    """
    check_origin(request)
    if not tokens_equal(form.get("csrf_token"), user.csrf_token):
        raise Forbidden("the form's CSRF token is missing or wrong; reload the page and try again",
                        code="csrf_failed")


def render(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """Render ``templates/<template>`` with ``context`` (autoescaped) as an HTML response."""
    context.setdefault("user", None)
    html = _env.get_template(template).render(request=request, **context)
    return HTMLResponse(html, status_code=status_code)


def error_page(request: Request, exc: RagBudgetError, user: ConsoleUser | None = None) -> HTMLResponse:
    """An HTML page for a ragbudget error, with the status the REST API would give it."""
    return render(request, "error.html", status_code=status_for(exc), code=exc.code, message=exc.message,
                  details=exc.details, user=user)


def login_redirect(request: Request, reason: str = "") -> RedirectResponse:
    """303 to the sign-in page; ``next`` is this page (path and query only) for a GET."""
    target = "/ui/login"
    params = []
    if request.method == "GET" and request.url.path != "/ui/login":
        nxt = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        params.append("next=" + quote(nxt, safe=""))
    if reason:
        params.append(f"reason={reason}")
    if params:
        target += "?" + "&".join(params)
    return RedirectResponse(target, status_code=303)


def safe_next(value: str | None) -> str:
    """A local console path to go to after sign-in (never another host), default the receipts list."""
    if value and value.startswith("/ui/") and not value.startswith("//") and "\\" not in value:
        return value
    return "/ui/receipts"


class ConsoleRoute(APIRoute):
    """An APIRoute whose errors are HTML pages and whose responses carry the console headers."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """The route's handler, wrapped: a missing or expired sign-in redirects to the sign-in
        page, a ``RagBudgetError`` or a request validation error becomes an HTML error page
        (its status from the error), and every response gets the console's security headers
        and a ``Server-Timing: app;dur=<ms>`` header."""
        handler = super().get_route_handler()

        async def _handle(request: Request) -> Response:
            start = time.perf_counter()
            try:
                response = await handler(request)
            except LoginRequired as exc:
                response = login_redirect(request, exc.reason)
            except RagBudgetError as exc:
                response = error_page(request, exc)
            except RequestValidationError as exc:
                problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:])}: {e.get('msg')}"
                                     for e in exc.errors())
                response = error_page(request, InvalidInput(problems or "invalid request",
                                                            code="invalid_request"))
            for name, value in SECURITY_HEADERS.items():
                response.headers.setdefault(name, value)
            response.headers["Server-Timing"] = f"app;dur={(time.perf_counter() - start) * 1000.0:.1f}"
            return response

        return _handle
