"""TrustedProxyMiddleware: X-Forwarded-For/-Proto/-Host are believed from trusted peers only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.api.proxy import TrustedProxyMiddleware


def _seen(trusted: list[str], peer: str, headers: dict[str, str]) -> dict[str, Any]:
    """What the app behind the middleware sees of one request from ``peer``."""
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], _receive: Any, _send: Any) -> None:
        seen.update(client=scope["client"][0], scheme=scope["scheme"],
                    host=dict(scope["headers"]).get(b"host", b"").decode())

    scope = {"type": "http", "scheme": "http", "client": (peer, 5000),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(TrustedProxyMiddleware(app, trusted)(scope, None, None))
    return seen


FORWARDED = {"Host": "127.0.0.1:8000", "X-Forwarded-For": "203.0.113.7, 10.1.2.3",
             "X-Forwarded-Proto": "https", "X-Forwarded-Host": "spoofed.example, ragbudget.example.com"}


def test_a_trusted_peer_sets_client_scheme_and_host():
    seen = _seen(["10.0.0.0/8"], "10.0.0.2", FORWARDED)
    # the client is the right-most address that is not itself a trusted proxy (uvicorn's rule)
    assert seen == {"client": "203.0.113.7", "scheme": "https", "host": "ragbudget.example.com"}


@pytest.mark.parametrize("peer", ["192.0.2.9", "11.0.0.1", "::1", "testclient"])
def test_an_untrusted_peer_changes_nothing(peer):
    assert _seen(["10.0.0.0/8"], peer, FORWARDED) == {"client": peer, "scheme": "http",
                                                      "host": "127.0.0.1:8000"}


@pytest.mark.parametrize("bad", ["evil.example/path", "a b", "evil.example:99999999", "@evil", ""])
def test_a_malformed_forwarded_host_is_ignored(bad):
    seen = _seen(["127.0.0.1"], "127.0.0.1", {"Host": "127.0.0.1:8000", "X-Forwarded-Host": bad})
    assert seen["host"] == "127.0.0.1:8000"


def test_star_trusts_every_peer_and_ipv6_networks_work():
    assert _seen(["*"], "192.0.2.9", FORWARDED)["host"] == "ragbudget.example.com"
    assert _seen(["fd00::/8"], "fd00::5", FORWARDED)["scheme"] == "https"
