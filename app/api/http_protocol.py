"""The HTTP protocol ``ragbudget serve`` runs: uvicorn's h11 protocol, with the 400 it answers
itself in the error envelope.

A request the HTTP parser rejects (a non-numeric ``Content-Length``, a header block over
h11's limit, a malformed request line) never reaches the application, so no route or
exception handler can shape its answer; uvicorn writes a plain-text 400. This protocol
writes the same 400 as ``{"error": {"code": "bad_http_request", "message", "details"}}``
(``application/json``) and closes the connection, as uvicorn does.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

BAD_HTTP_REQUEST = "bad_http_request"


class EnvelopeH11Protocol(H11Protocol):
    """``uvicorn.Config(http=EnvelopeH11Protocol)``: uvicorn's h11 protocol whose own 400
    answers carry the JSON error envelope."""

    def send_400_response(self, msg: str) -> None:
        """Answer 400 with the envelope (``msg`` from uvicorn, e.g. ``Invalid HTTP request
        received.``) and close the connection."""
        body = json.dumps({"error": {"code": BAD_HTTP_REQUEST, "message": msg,
                                     "details": {"where": "http_parser"}}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers,
                                                             reason=b"Bad Request")) or b"")
            self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            # h11 refuses to send a response in this connection state (the parser failed
            # before a request was read far enough): write the bytes directly.
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\n" + b"".join(
                k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n" + body)
        self.transport.close()
