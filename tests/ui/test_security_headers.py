"""Every response carries frame, sniffing, referrer and content-security headers; the API docs
pages load no third-party script or style (Swagger UI and ReDoc served from local assets)."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest
from fastapi.testclient import TestClient

from tests.ui.world import ConsoleWorld

# Script and style references of a page: <script src>, <link href>, and CSS @import/url() in <style>.
_REFS = re.compile(r"""<script[^>]*\bsrc=["']?([^"' >]+)|<link[^>]*\bhref=["']?([^"' >]+)|"""
                   r"""@import\s+(?:url\()?["']?([^"')\s;]+)""", re.IGNORECASE)
_INLINE = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>(.*?)</script>", re.DOTALL | re.IGNORECASE)


def _policy(csp: str) -> dict[str, list[str]]:
    return {d.split()[0]: d.split()[1:] for d in (p.strip() for p in csp.split(";")) if d}


@pytest.fixture(scope="module")
def client(world: ConsoleWorld):  # type: ignore[no-untyped-def]
    with TestClient(world.app) as c:
        yield c


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/docs/oauth2-redirect", "/openapi.json", "/v1/health",
                                  "/metrics", "/v1/receipts", "/no/such/page", "/ui/login",
                                  "/ui/static/console.css", "/static-docs/swagger-ui.css"])
def test_every_response_refuses_framing_and_sniffing(client, path):
    r = client.get(path)
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "same-origin"
    policy = _policy(r.headers["content-security-policy"])
    assert policy["frame-ancestors"] == ["'none'"]
    assert all(not re.match(r"(https?:|\*|'unsafe-inline')", s)
               for s in policy.get("script-src", policy["default-src"])), policy


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_api_docs_load_no_third_party_script_or_style(client, path):
    r = client.get(path)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    refs = [next(g for g in m.groups() if g) for m in _REFS.finditer(r.text)]
    assert refs, "the page references no asset at all"
    assert all(ref.startswith("/") and not ref.startswith("//") for ref in refs), refs
    for ref in refs:  # and every one of them is served here
        assert client.get(ref).status_code == 200, ref
    assert "googleapis" not in r.text and "cdn.jsdelivr" not in r.text


@pytest.mark.parametrize("path", ["/docs", "/docs/oauth2-redirect"])
def test_docs_policy_allows_exactly_the_pages_own_inline_script(client, path):
    r = client.get(path)
    inline = _INLINE.findall(r.text)
    assert inline
    hashes = {f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in inline}
    script_src = _policy(r.headers["content-security-policy"])["script-src"]
    assert set(script_src) == {"'self'"} | hashes


def test_console_pages_keep_their_own_stricter_policy(client):
    csp = client.get("/ui/login").headers["content-security-policy"]
    assert _policy(csp)["script-src"] == ["'self'"] and "form-action 'self'" in csp
