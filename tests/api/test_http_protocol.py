"""What the HTTP parser refuses before the app sees a request is answered in the error envelope.

``ragbudget serve`` runs uvicorn with :class:`app.api.http_protocol.EnvelopeH11Protocol`;
plain uvicorn answers these with a plain-text 400 (checked here too, so the test fails if
the protocol stops mattering).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from app.api.http_protocol import BAD_HTTP_REQUEST, EnvelopeH11Protocol

BAD_REQUESTS = {
    "non-numeric Content-Length": b"POST /v1/answer HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n{}",
    "oversized header": b"GET /v1/health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
    "malformed request line": b"GET /v1/health HTTP/9.9 extra\r\nHost: t\r\n\r\n",
}


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _serve(http: Any) -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=port, http=http,
                                           log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def envelope_port() -> Iterator[int]:
    yield from _serve(EnvelopeH11Protocol)


@pytest.fixture(scope="module")
def plain_port() -> Iterator[int]:
    yield from _serve("h11")


def _raw(port: int, data: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        # The server may close mid-send (oversized header); its answer is still readable.
        with contextlib.suppress(OSError):
            c.sendall(data)
        chunks = []
        while True:
            try:
                b = c.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not b:
                break
            chunks.append(b)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines)}
    return status, headers, body


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_parser_400_is_in_the_envelope(envelope_port: int, plain_port: int, case: str) -> None:
    status, headers, body = _raw(envelope_port, BAD_REQUESTS[case])
    assert status.startswith(b"HTTP/1.1 400"), status
    assert headers[b"content-type"] == b"application/json"
    err = json.loads(body)["error"]
    assert err["code"] == BAD_HTTP_REQUEST and err["message"] and err["details"]["where"] == "http_parser"
    # Plain uvicorn answers the same request outside the envelope.
    status, headers, _ = _raw(plain_port, BAD_REQUESTS[case])
    assert status.startswith(b"HTTP/1.1 400") and headers.get(b"content-type") != b"application/json"


def test_a_good_request_is_served(envelope_port: int) -> None:
    status, _, body = _raw(envelope_port, b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200") and body == b"ok"
