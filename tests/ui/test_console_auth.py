"""Console sign-in, sessions, CSRF and roles, through the real app (TestClient)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.auth import create_key, revoke_key
from app.ui.sessions import SESSION_COOKIE, SessionStore
from app.ui.web import safe_next
from tests.ui.conftest import csrf_of, sign_in


def _cookie_header(response) -> str:
    return "; ".join(v for k, v in response.headers.multi_items()
                     if k == "set-cookie" and SESSION_COOKIE in v)


def test_signed_out_page_redirects_to_login_with_next(world):
    with TestClient(world.app) as c:
        r = c.get("/ui/receipts?status=ok", follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/ui/login?next=%2Fui%2Freceipts%3Fstatus%3Dok"


def test_operator_key_gets_httponly_strict_session_cookie(world):
    with TestClient(world.app) as c:
        page = c.get("/ui/login")
        r = c.post("/ui/login", data={"csrf_token": csrf_of(page.text), "api_key": world.keys["operator"]},
                   follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/receipts"
    cookie = _cookie_header(r).lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/ui" in cookie
    assert "secure" not in cookie  # plain HTTP: a Secure cookie would never come back


def test_session_cookie_is_secure_over_tls(world):
    with TestClient(world.app, base_url="https://testserver") as c:
        page = c.get("/ui/login")
        r = c.post("/ui/login", data={"csrf_token": csrf_of(page.text), "api_key": world.keys["admin"]},
                   follow_redirects=False)
    assert r.status_code == 303 and "secure" in _cookie_header(r).lower()


def test_key_never_appears_in_url_cookie_or_pages(world):
    key = world.keys["operator"]
    with TestClient(world.app) as c:
        page = c.get("/ui/login")
        r = c.post("/ui/login", data={"csrf_token": csrf_of(page.text), "api_key": key})
        pages = [r.text, c.get(f"/ui/receipts/{world.receipts[0]}").text, c.get("/ui/tuning").text]
        cookies = "".join(c.cookies.values())
    secret = key.split("_", 2)[2]
    assert all(secret not in p for p in pages) and secret not in cookies
    assert secret not in str(r.url) and all(secret not in str(h.url) for h in r.history)


def test_copilot_key_is_refused_with_403_and_no_session(world):
    with TestClient(world.app) as c:
        page = c.get("/ui/login")
        r = c.post("/ui/login", data={"csrf_token": csrf_of(page.text), "api_key": world.keys["copilot"]},
                   follow_redirects=False)
        assert r.status_code == 403 and "cannot sign in" in r.text
        assert SESSION_COOKIE not in c.cookies
        assert c.get("/ui/receipts", follow_redirects=False).status_code == 303


def test_unknown_key_is_401_and_the_form_comes_back_empty(world):
    with TestClient(world.app) as c:
        page = c.get("/ui/login")
        bogus = "rb_0123456789abcdef_" + "y" * 43
        r = c.post("/ui/login", data={"csrf_token": csrf_of(page.text), "api_key": bogus})
    assert r.status_code == 401 and "y" * 43 not in r.text


def test_login_without_the_csrf_token_is_refused(world):
    with TestClient(world.app) as c:
        c.get("/ui/login")
        r = c.post("/ui/login", data={"api_key": world.keys["operator"]}, follow_redirects=False)
    assert r.status_code == 403 and "csrf_failed" in r.text


def test_cross_origin_post_is_refused_even_with_the_token(world, operator):
    page = operator.get(f"/ui/receipts/{world.receipts[0]}")
    r = operator.post(f"/ui/receipts/{world.receipts[0]}/replay", data={"csrf_token": csrf_of(page.text)},
                      headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "csrf_failed" in r.text


@pytest.mark.parametrize("token", [None, "forged-token"])
def test_replay_form_without_the_session_csrf_token_is_refused(world, operator, token):
    data = {} if token is None else {"csrf_token": token}
    r = operator.post(f"/ui/receipts/{world.receipts[0]}/replay", data=data)
    assert r.status_code == 403 and "csrf_failed" in r.text and 'data-check="' not in r.text


def test_sign_out_needs_the_csrf_token(world, operator):
    r = operator.post("/ui/logout", data={"csrf_token": "nope"}, follow_redirects=False)
    assert r.status_code == 403
    assert operator.get("/ui/receipts", follow_redirects=False).status_code == 200


def test_sign_out_ends_the_session_server_side(world, operator):
    page = operator.get("/ui/receipts")
    stolen = operator.cookies.get(SESSION_COOKIE)
    r = operator.post("/ui/logout", data={"csrf_token": csrf_of(page.text)}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login?reason=signed_out"
    with TestClient(world.app) as other:  # the old cookie, replayed, opens nothing
        other.cookies.set(SESSION_COOKIE, stolen, path="/ui")
        assert other.get("/ui/receipts", follow_redirects=False).status_code == 303


def test_revoking_the_key_ends_its_sessions(world):
    principal, key = create_key(world.services.engine, "operator", "short-lived")
    with TestClient(world.app) as c:
        sign_in(c, key)
        assert c.get("/ui/receipts", follow_redirects=False).status_code == 200
        revoke_key(world.services.engine, principal.id)
        r = c.get("/ui/receipts", follow_redirects=False)
    assert r.status_code == 303 and "reason=revoked" in r.headers["location"]


def test_console_pages_carry_security_headers(operator):
    r = operator.get("/ui/receipts")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["cache-control"] == "no-store" and r.headers["x-frame-options"] == "DENY"
    assert r.headers["server-timing"].startswith("app;dur=")


@pytest.mark.parametrize("value", ["//evil.example/ui/x", "https://evil.example/", "/v1/keys", "/ui\\..",
                                   None])
def test_next_after_sign_in_stays_inside_the_console(value):
    assert safe_next(value) == "/ui/receipts"


def test_next_after_sign_in_keeps_a_console_path():
    assert safe_next("/ui/receipts?status=ok") == "/ui/receipts?status=ok"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_session_ends_after_idle_timeout():
    clock = _Clock()
    store = SessionStore(idle_s=60, max_s=3600, clock=clock)
    token, _ = store.create(_principal())
    clock.now += 59
    assert store.get(token) is not None
    clock.now += 61
    assert store.get(token) is None and len(store) == 0


def test_session_ends_at_max_age_however_active():
    clock = _Clock()
    store = SessionStore(idle_s=60, max_s=100, clock=clock)
    token, _ = store.create(_principal())
    for _ in range(3):
        clock.now += 40
        found = store.get(token)
    assert found is None


def test_store_keeps_only_token_digests():
    store = SessionStore(idle_s=60, max_s=100)
    token, _ = store.create(_principal())
    assert token not in repr(store._sessions)


def _principal():
    from app.auth import Principal

    return Principal("k1", "ops", "operator")


def test_auth_disabled_console_continues_without_a_key(tmp_path, ui_profile):
    from tests.ui.world import build_world

    w = build_world(tmp_path, ui_profile, auth_enabled=False)
    with TestClient(w.app) as c:
        page = c.get("/ui/login")
        assert "Authentication is disabled" in page.text
        r = c.post("/ui/login", data={"csrf_token": csrf_of(page.text)})
        assert r.status_code == 200 and "auth disabled (admin)" in r.text
    w.services.close()
