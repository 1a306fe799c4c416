"""Sign-in and sign-out: ``GET/POST /ui/login``, ``POST /ui/logout``, ``GET /ui``.

The key travels once, in the body of a POST form (a password field); it is never
put in a URL, a log line or a page, and never stored: the session keeps the key's
id and role only (:mod:`app.ui.sessions`). Copilot keys are refused with 403.
"""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import RedirectResponse, Response

from app.auth import ANONYMOUS_ADMIN, authenticate
from app.services import Services
from app.ui.sessions import COOKIE_PATH, LOGIN_CSRF_COOKIE, SESSION_COOKIE, SessionStore, tokens_equal
from app.ui.web import (
    CONSOLE_ROLE,
    ConsoleRoute,
    ConsoleUser,
    check_csrf,
    check_origin,
    console_user,
    form_fields,
    get_services,
    get_store,
    render,
    safe_next,
)
from foundation.errors import Forbidden, Unauthenticated

router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)

REASONS = {"expired": "Your session has ended. Sign in again.",
           "revoked": "The key behind your session was revoked.",
           "signed_out": "You are signed out."}


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


def _login_page(request: Request, services: Services, *, status_code: int = 200, error: str = "",
                reason: str = "", next_path: str = "") -> Response:
    """The sign-in form with a fresh double-submit CSRF token (cookie + hidden field)."""
    token = secrets.token_urlsafe(32)
    response = render(request, "login.html", status_code=status_code, csrf_token=token, error=error,
                      notice=REASONS.get(reason, ""), next_path=safe_next(next_path),
                      auth_enabled=services.settings.auth_enabled)
    response.set_cookie(LOGIN_CSRF_COOKIE, token, max_age=3600, path=COOKIE_PATH, httponly=True,
                        samesite="strict", secure=_secure(request))
    return response


@router.get("/ui")
@router.get("/ui/")
def home() -> RedirectResponse:
    """The console starts at the receipts list."""
    return RedirectResponse("/ui/receipts", status_code=303)


@router.get("/ui/login")
def login_form(request: Request, reason: str = "", next_path: str = Query("", alias="next"),
               services: Services = Depends(get_services)) -> Response:
    """The sign-in page (an API key of role operator or admin)."""
    return _login_page(request, services, reason=reason, next_path=next_path)


@router.post("/ui/login")
def login(request: Request, form: dict[str, str] = Depends(form_fields),
          services: Services = Depends(get_services), store: SessionStore = Depends(get_store)) -> Response:
    """Exchange a key for a session cookie, then 303 to ``next`` (a console path).

    401 page: missing, malformed, unknown or revoked key. 403 page: a copilot key, or a
    form without the sign-in CSRF token (``csrf_failed``). Nothing is stored on failure.
    """
    check_origin(request)
    if not tokens_equal(form.get("csrf_token"), request.cookies.get(LOGIN_CSRF_COOKIE)):
        raise Forbidden("the sign-in form's CSRF token is missing or wrong; reload the page",
                        code="csrf_failed")
    next_path = form.get("next", "")
    if services.settings.auth_enabled:
        try:
            principal = authenticate(services.engine, form.get("api_key", "").strip())
        except Unauthenticated as exc:
            return _login_page(request, services, status_code=401, error=exc.message, next_path=next_path)
        if not principal.allows(CONSOLE_ROLE):
            return _login_page(request, services, status_code=403, next_path=next_path,
                               error=f"A {principal.role} key cannot sign in to the console; "
                                     "use an operator or admin key.")
    else:
        principal = ANONYMOUS_ADMIN
    token, _session = store.create(principal)
    response = RedirectResponse(safe_next(next_path), status_code=303)
    response.set_cookie(SESSION_COOKIE, token, path=COOKIE_PATH, httponly=True, samesite="strict",
                        secure=_secure(request))
    response.delete_cookie(LOGIN_CSRF_COOKIE, path=COOKIE_PATH)
    return response


@router.post("/ui/logout")
def logout(request: Request, user: ConsoleUser = Depends(console_user),
           form: dict[str, str] = Depends(form_fields), store: SessionStore = Depends(get_store)) -> Response:
    """End the session (CSRF-checked) and clear the cookie; 303 to the sign-in page."""
    check_csrf(request, user, form)
    store.end(user.token)
    response = RedirectResponse("/ui/login?reason=signed_out", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict",
                           secure=_secure(request))
    return response
