"""Running behind a reverse proxy: which forwarded headers are believed, and from whom.

A proxy (nginx, Caddy, a cloud load balancer) connects to ragbudget itself, so
the peer address is the proxy's and, with nginx's default ``proxy_pass``, the
``Host`` header is the upstream's (``127.0.0.1:8000``), not the name the browser
used. The proxy says what the browser saw in ``X-Forwarded-For``,
``X-Forwarded-Proto`` and ``X-Forwarded-Host``. Anyone can send those headers, so
they are believed only from a peer in the ``trusted_proxies`` setting (IP
addresses and CIDR networks, or ``*``).

:class:`TrustedProxyMiddleware` does, for a trusted peer only:

* ``X-Forwarded-For`` and ``X-Forwarded-Proto``: uvicorn's
  :class:`uvicorn.middleware.proxy_headers.ProxyHeadersMiddleware` (the client is the
  right-most address that is not itself a trusted proxy; the scheme is ``http`` or
  ``https``), so the semantics are uvicorn's own ``--forwarded-allow-ips``;
* ``X-Forwarded-Host``: its right-most value (the one the nearest proxy wrote, as
  Werkzeug's ``ProxyFix(x_host=1)`` reads it) replaces ``Host`` when it is a
  well-formed ``host[:port]``, so the request's URL, and the console's CSRF origin
  check (:func:`app.ui.web.check_origin`), use the name the browser used.

From any other peer the headers are left untouched and ignored: nothing in the
app reads them. ``ragbudget serve`` turns uvicorn's own proxy-header handling off,
so this setting alone decides (docs/console.md, "Behind a reverse proxy").
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

Scope = dict[str, Any]
# host[:port]: a DNS name or IPv4 address, or a bracketed IPv6 address (RFC 9110 section 7.2).
_HOST = re.compile(rb"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\])(?::[0-9]{1,5})?")
AddressNet = ipaddress.IPv4Network | ipaddress.IPv6Network


class TrustedProxyMiddleware:
    """ASGI middleware believing ``X-Forwarded-*`` headers from ``trusted`` peers only.

    Args:
        app: the ASGI app to call.
        trusted: IP addresses and CIDR networks (``"10.0.0.0/8"``), or ``["*"]`` for every
            peer; already validated by :class:`app.settings.Settings`.

    Raises:
        ValueError: an entry that is neither an address, a network nor ``*``.
    """

    def __init__(self, app: Any, trusted: list[str]) -> None:
        self.app = app
        self.trust_all = trusted == ["*"]
        self.networks: list[AddressNet] = ([] if self.trust_all else
                                           [ipaddress.ip_network(t, strict=False) for t in trusted])
        self._forwarded = ProxyHeadersMiddleware(app, trusted_hosts=trusted)

    def trusts(self, peer: str | None) -> bool:
        """True when ``peer`` (the connecting address) is a trusted proxy."""
        if self.trust_all:
            return True
        if not peer:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False  # e.g. a unix socket path: never a trusted address
        return any(address in net for net in self.networks)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        if not self.trusts(client[0] if client else None):
            await self.app(scope, receive, send)
            return
        forwarded_host = forwarded_host_of(scope["headers"])
        if forwarded_host is not None:
            kept = [(k, v) for k, v in scope["headers"] if k != b"host"]
            scope["headers"] = [*kept, (b"host", forwarded_host)]
        await self._forwarded(scope, receive, send)  # type: ignore[arg-type]


def forwarded_host_of(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The right-most ``X-Forwarded-Host`` value when it is a well-formed ``host[:port]``, else None."""
    values = [v for k, v in headers if k == b"x-forwarded-host"]
    if not values:
        return None
    last = b",".join(values).split(b",")[-1].strip()
    return last if _HOST.fullmatch(last) else None
