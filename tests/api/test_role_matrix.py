"""Every route's role matrix: who gets 401, who gets 403, who reaches the handler.

``ROUTE_ROLES`` is the access-control table of the API. The app's route list
must equal its keys, so a route added without an entry here fails
:func:`test_route_table_lists_exactly_the_apps_routes`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI

from app.auth import ROLES
from tests.api.conftest import KeyedApp, api_settings, start_keyed_app

OPEN = "open"
# Console pages (tests/ui) take a session cookie made by signing in, never a header key: every
# caller of this matrix (header or none) is sent to the sign-in page.
CONSOLE = "console session"

ROUTE_ROLES: dict[tuple[str, str], str] = {
    # FastAPI's own documentation routes and the liveness probe.
    ("GET", "/openapi.json"): OPEN,
    ("GET", "/docs"): OPEN,
    ("GET", "/docs/oauth2-redirect"): OPEN,
    ("GET", "/redoc"): OPEN,
    ("GET", "/healthz"): OPEN,
    ("GET", "/health"): OPEN,
    ("GET", "/v1/health"): OPEN,
    ("GET", "/metrics"): OPEN,  # operator when metrics_public=false (tested below)
    # copilot: answer, advise, retrieve, browse revisions and latency profiles
    ("POST", "/v1/answer"): "copilot",
    ("POST", "/v1/advise"): "copilot",
    ("GET", "/v1/advise/curve"): "copilot",
    ("POST", "/v1/chat/completions"): "copilot",
    ("POST", "/v1/completions"): "copilot",
    ("GET", "/v1/models"): "copilot",
    ("GET", "/v1/models/{model_id:path}"): "copilot",
    ("POST", "/v1/retrieve"): "copilot",
    ("GET", "/v1/revisions"): "copilot",
    ("GET", "/v1/revisions/{number}"): "copilot",
    ("GET", "/v1/latency/profiles"): "copilot",
    ("GET", "/v1/latency/profiles/{profile_id}"): "copilot",
    # operator: anything that returns document text or receipt bodies, and replay
    ("GET", "/v1/documents/{document_id:path}"): "operator",
    ("GET", "/v1/documents/{document_id:path}/versions"): "operator",
    ("GET", "/v1/documents/{document_id:path}/versions/{version}"): "operator",
    ("GET", "/v1/document"): "operator",
    ("GET", "/v1/document/versions"): "operator",
    ("GET", "/v1/document/versions/{version}"): "operator",
    ("GET", "/v1/receipts"): "operator",
    ("GET", "/v1/receipts/{receipt_id}"): "operator",
    ("POST", "/v1/receipts/{receipt_id}/replay"): "operator",
    ("GET", "/v1/engines"): "operator",  # engines' addresses, health and load
    # admin: change the corpus, manage keys
    ("POST", "/v1/documents"): "admin",
    ("DELETE", "/v1/documents/{document_id:path}"): "admin",
    ("DELETE", "/v1/document"): "admin",
    ("POST", "/v1/keys"): "admin",
    ("GET", "/v1/keys"): "admin",
    ("DELETE", "/v1/keys/{key_id}"): "admin",
    # the operator console
    ("GET", "/ui"): OPEN,
    ("GET", "/ui/"): OPEN,
    ("GET", "/ui/login"): OPEN,
    ("POST", "/ui/login"): OPEN,
    ("POST", "/ui/logout"): CONSOLE,
    ("GET", "/ui/receipts"): CONSOLE,
    ("GET", "/ui/receipts/{receipt_id}"): CONSOLE,
    ("POST", "/ui/receipts/{receipt_id}/replay"): CONSOLE,
    ("GET", "/ui/tuning"): CONSOLE,
    ("GET", "/ui/corpus"): CONSOLE,
    ("GET", "/ui/corpus/revisions/{number}"): CONSOLE,
    ("GET", "/ui/corpus/documents"): CONSOLE,
    ("GET", "/ui/corpus/documents/{document_id:path}"): CONSOLE,
}

# A harmless value for each path parameter: the handler answers 404 or 422 at worst.
PATH_VALUES = {"number": "999", "profile_id": "sha256:" + "0" * 64, "document_id:path": "no/such.txt",
               "version": "1", "receipt_id": "rcpt_missing", "key_id": "0000000000000000",
               "model_id:path": "ragbudget"}
UNAUTHENTICATED = ("none", "malformed", "unknown", "revoked")
CALLERS = (*UNAUTHENTICATED, *ROLES)


def iter_routes(routes: list[Any]) -> Iterator[Any]:
    """Every route with a path, descending into included routers (FastAPI >= 0.16x nests them)."""
    for route in routes:
        if hasattr(route, "path") and hasattr(route, "methods"):
            yield route
        elif hasattr(route, "effective_route_contexts"):
            yield from route.effective_route_contexts()
        elif hasattr(route, "routes"):
            yield from iter_routes(route.routes)


def app_routes(app: FastAPI) -> set[tuple[str, str]]:
    """``{(method, path template)}`` served by ``app`` (HEAD is implied by GET and left out)."""
    return {(m, r.path) for r in iter_routes(list(app.routes)) for m in r.methods or () if m != "HEAD"}


def declared_roles(route: Any) -> set[str]:
    """Roles named by ``require_role`` dependencies anywhere in a route's dependency tree."""
    found: set[str] = set()
    stack = [route.dependant]
    while stack:
        dep = stack.pop()
        role = getattr(dep.call, "required_role", None)
        if role is not None:
            found.add(role)
        stack.extend(dep.dependencies)
    return found


def concrete(path: str) -> str:
    return re.sub(r"\{([^}]+)\}", lambda m: PATH_VALUES[m.group(1)], path)


def call(app: KeyedApp, method: str, path: str, who: str) -> Any:
    kwargs: dict[str, Any] = {"headers": app.headers(who)}
    if method == "POST":
        kwargs["json"] = {}
    return app.client.request(method, concrete(path), **kwargs)


def expected(minimum: str, who: str) -> str:
    """``"401"``, ``"403"`` or ``"pass"`` for a caller against a route's minimal role."""
    if minimum == OPEN:
        return "pass"
    if who in UNAUTHENTICATED:
        return "401"
    return "pass" if ROLES.index(who) >= ROLES.index(minimum) else "403"


def test_route_table_lists_exactly_the_apps_routes(secured: KeyedApp) -> None:
    assert app_routes(secured.client.app) == set(ROUTE_ROLES)  # type: ignore[arg-type]


def test_every_v1_route_declares_its_role_with_require_role(secured: KeyedApp) -> None:
    # The open ones (the /v1/health probe, as llama.cpp's server has it) declare none.
    declared = {(m, r.path): declared_roles(r) for r in iter_routes(list(secured.client.app.routes))  # type: ignore[attr-defined]
                if r.path.startswith("/v1/") for m in r.methods if ROUTE_ROLES.get((m, r.path)) != OPEN}
    wrong = {k: v for k, v in declared.items() if v != {ROUTE_ROLES[k]}}
    assert declared and not wrong


@pytest.mark.parametrize("who", CALLERS)
@pytest.mark.parametrize(("method", "path"), sorted(ROUTE_ROLES))
def test_role_matrix(secured: KeyedApp, method: str, path: str, who: str) -> None:
    r = call(secured, method, path, who)
    if ROUTE_ROLES[(method, path)] == CONSOLE:
        assert r.history and r.history[0].status_code == 303 and r.url.path == "/ui/login", r.text
        return
    outcome = expected(ROUTE_ROLES[(method, path)], who)
    if outcome == "pass":
        assert r.status_code not in (401, 403) and r.status_code < 500, r.text
        return
    assert r.status_code == int(outcome), r.text
    assert r.json()["error"]["code"] == ("unauthenticated" if outcome == "401" else "forbidden")
    if outcome == "401":
        assert r.headers["WWW-Authenticate"] == "Bearer"
    else:
        assert r.json()["error"]["details"]["required_role"] == ROUTE_ROLES[(method, path)]


def test_key_is_also_accepted_in_x_api_key_header(secured: KeyedApp) -> None:
    r = secured.client.get("/v1/keys", headers={"X-API-Key": secured.keys["admin"]})
    assert r.status_code == 200 and {k["role"] for k in r.json()} >= set(ROLES)


@pytest.fixture(scope="module")
def private_metrics(tmp_path_factory: pytest.TempPathFactory, api_profile: Any) -> Iterator[KeyedApp]:
    app = start_keyed_app(api_settings(tmp_path_factory.mktemp("metrics"), metrics_public=False),
                          api_profile)
    with app.client:
        yield app
    app.services.close()


@pytest.mark.parametrize("who", CALLERS)
def test_metrics_need_operator_when_not_public(private_metrics: KeyedApp, who: str) -> None:
    r = private_metrics.client.get("/metrics", headers=private_metrics.headers(who))
    outcome = expected("operator", who)
    if outcome == "pass":
        assert r.status_code == 200 and "ragbudget_answers_total" in r.text
    else:
        assert r.status_code == int(outcome)
        assert r.json()["error"]["code"] == ("unauthenticated" if outcome == "401" else "forbidden")


def test_healthz_and_public_metrics_need_no_key(secured: KeyedApp) -> None:
    assert secured.client.get("/healthz").json()["status"] == "ok"
    r = secured.client.get("/metrics")
    assert r.status_code == 200 and "ragbudget_ttft_ms" in r.text
