"""The console behind a reverse proxy: forwarded headers believed from trusted proxies only,
and extra trusted origins for the CSRF origin check (``trusted_proxies``, ``trusted_origins``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.settings import get_settings
from app.ui.sessions import LOGIN_CSRF_COOKIE, SESSION_COOKIE
from tests.ui.conftest import csrf_of
from tests.ui.world import ConsoleWorld, build_world

PROXY = ("10.0.0.2", 40000)  # inside the trusted 10.0.0.0/8
STRANGER = ("192.0.2.9", 40000)  # outside it
PUBLIC = "ragbudget.example.com"
# What nginx's default proxy_pass sends upstream: Host is the upstream's, the browser's name is forwarded.
NGINX = {"Host": "127.0.0.1:8000", "X-Forwarded-Host": PUBLIC, "X-Forwarded-Proto": "https",
         "X-Forwarded-For": "203.0.113.7"}


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory, ui_profile) -> Iterator[ConsoleWorld]:  # type: ignore[no-untyped-def]
    w = build_world(tmp_path_factory.mktemp("proxied"), ui_profile, trusted_proxies="10.0.0.0/8",
                    trusted_origins="https://*.ops.example.net")
    yield w
    w.services.close()


def _cookie(response, name: str) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """(value, attributes) of the Set-Cookie header for ``name``."""
    for k, v in response.headers.multi_items():
        if k == "set-cookie" and v.startswith(name + "="):
            return v.split(";", 1)[0].split("=", 1)[1], v.lower()
    raise AssertionError(f"no {name} cookie set")


def _sign_in_through(world: ConsoleWorld, peer: tuple[str, int], origin: str, headers: dict[str, str]):  # type: ignore[no-untyped-def]
    """GET the sign-in form and POST it back as a browser behind the proxy would (the login
    cookie sent by hand: a Secure cookie would not come back over the test's plain HTTP)."""
    with TestClient(world.app, client=peer) as c:
        page = c.get("/ui/login", headers=headers)
        token, attributes = _cookie(page, LOGIN_CSRF_COOKIE)
        r = c.post("/ui/login", data={"csrf_token": csrf_of(page.text), "api_key": world.keys["operator"]},
                   headers={**headers, "Origin": origin, "Cookie": f"{LOGIN_CSRF_COOKIE}={token}"},
                   follow_redirects=False)
    return attributes, r


def test_sign_in_through_a_trusted_proxy_that_rewrites_host_is_accepted(proxied):
    login_cookie, r = _sign_in_through(proxied, PROXY, f"https://{PUBLIC}", NGINX)
    assert r.status_code == 303, r.text
    assert "secure" in login_cookie  # the browser spoke HTTPS to the proxy
    assert "secure" in _cookie(r, SESSION_COOKIE)[1]


def test_forwarded_headers_from_an_untrusted_peer_are_ignored(proxied):
    login_cookie, r = _sign_in_through(proxied, STRANGER, f"https://{PUBLIC}", NGINX)
    assert r.status_code == 403 and "csrf_failed" in r.text
    assert "secure" not in login_cookie  # X-Forwarded-Proto not believed either


def test_a_trusted_proxy_cannot_vouch_for_another_origin(proxied):
    _cookie_attrs, r = _sign_in_through(proxied, PROXY, "https://evil.example", NGINX)
    assert r.status_code == 403 and "csrf_failed" in r.text


@pytest.mark.parametrize(("origin", "accepted"), [
    ("https://console.ops.example.net", True),  # a subdomain of the trusted wildcard
    ("https://ops.example.net", False),  # the wildcard's own domain is not one of its subdomains
    ("http://console.ops.example.net", False),  # other scheme
    ("https://console.ops.example.net:8443", False),  # other port
    ("https://evil.example", False),
])
def test_trusted_origins_extend_the_csrf_origin_check(proxied, origin, accepted):
    headers = {"Host": "127.0.0.1:8000"}  # no forwarded headers: only the origin list can accept
    _cookie_attrs, r = _sign_in_through(proxied, STRANGER, origin, headers)
    assert (r.status_code == 303) is accepted, r.text
    if not accepted:
        assert "csrf_failed" in r.text


def test_without_settings_a_proxy_that_rewrites_host_is_refused(world):
    """The server as shipped trusts no proxy: the same sign-in is refused (docs/console.md)."""
    _cookie_attrs, r = _sign_in_through(world, PROXY, f"https://{PUBLIC}", NGINX)
    assert r.status_code == 403 and "csrf_failed" in r.text


@pytest.mark.parametrize(("field", "value"), [
    ("trusted_proxies", "nginx.internal"), ("trusted_proxies", "10.0.0.0/33"),
    ("trusted_proxies", "*,10.0.0.1"), ("trusted_origins", "ragbudget.example.com"),
    ("trusted_origins", "https://ragbudget.example.com/ui"), ("trusted_origins", "ftp://example.com"),
])
def test_malformed_proxy_and_origin_settings_are_refused_at_start(field, value):
    with pytest.raises(ValidationError, match=field):
        get_settings(**{field: value})


def test_proxy_and_origin_settings_are_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("RAGBUDGET_TRUSTED_PROXIES", " 127.0.0.1, 10.0.0.0/8 ")
    monkeypatch.setenv("RAGBUDGET_TRUSTED_ORIGINS", "https://RagBudget.example.com/")
    s = get_settings()
    assert s.trusted_proxy_list == ["127.0.0.1", "10.0.0.0/8"]
    assert s.trusted_origin_list == ["https://ragbudget.example.com"]
