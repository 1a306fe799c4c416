"""A remote stream's first-token deadline: the answer's first token by a given time, or the
request is ended (a server that accepted the request and then sends nothing is not waited on
for the whole read timeout).

A streamed completion has two silent phases before its first token:

* the response headers: llama.cpp's native server sends them with its first result (so a
  stalled or stopped server sends nothing at all), vLLM and SGLang send them at once;
* the body up to the first chunk with text (the prefill, and any wait in the engine's queue).

The first phase is bounded by the request's own read timeout, clipped to what is left until the
deadline (:func:`header_timeout`). The second by :class:`FirstTokenWatch`: a timer that, at the
deadline, shuts the connection's socket down (``shutdown(SHUT_RDWR)`` wakes a ``recv`` blocked
in another thread on Linux) unless the first token came first; the read then fails and the
caller raises :func:`first_token_timeout`. Before the body is read, the request's read timeout
goes back to the client's own (:func:`restore_read_timeout`): httpcore reads it from the
request's ``extensions["timeout"]`` when the body iteration starts (``httpcore/_sync/http11.py``,
``_receive_response_body``), so later chunks keep the per-chunk timeout they always had.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import httpx

from foundation.errors import BackendError

#: The least read timeout given to a request whose deadline is (almost) due, s: httpx treats
#: 0 as "no wait", which fails the read before the server had any chance to answer.
MIN_READ_S = 0.001


def header_timeout(client_timeout: httpx.Timeout, deadline_t: float, now_t: float) -> httpx.Timeout:
    """The client's timeouts with the read timeout clipped to ``deadline_t - now_t`` seconds
    (``perf_counter`` seconds; at least :data:`MIN_READ_S`, at most the client's own read
    timeout when it has one)."""
    left_s = max(deadline_t - now_t, MIN_READ_S)
    read = left_s if client_timeout.read is None else min(client_timeout.read, left_s)
    return httpx.Timeout(connect=client_timeout.connect, read=read, write=client_timeout.write,
                         pool=client_timeout.pool)


def restore_read_timeout(resp: httpx.Response, client_timeout: httpx.Timeout) -> None:
    """Give the body of ``resp`` the client's own read timeout per chunk (see the module
    docstring); a no-op when the request carries no timeout dictionary."""
    ext = resp.request.extensions
    timeouts = ext.get("timeout")
    if isinstance(timeouts, dict):
        ext["timeout"] = {**timeouts, "read": client_timeout.read}


class FirstTokenWatch:
    """Shuts ``resp``'s connection down at ``deadline_t`` unless :meth:`disarm` was called first.

    Args:
        resp: a streamed response whose headers arrived (its ``network_stream`` extension
            holds the socket; without one the watch does nothing and the read timeout rules).
        deadline_t: ``time.perf_counter()`` seconds.

    Attributes:
        fired: the deadline passed before the first token; the connection was shut down.
    """

    def __init__(self, resp: httpx.Response, deadline_t: float) -> None:
        self.fired = False
        self._lock = threading.Lock()
        self._armed = True
        stream = resp.extensions.get("network_stream")
        self._sock: socket.socket | None = None
        if stream is not None and hasattr(stream, "get_extra_info"):
            sock = stream.get_extra_info("socket")
            self._sock = sock if isinstance(sock, socket.socket) else None
        self._timer = threading.Timer(max(deadline_t - time.perf_counter(), 0.0), self._fire)
        self._timer.daemon = True
        self._timer.name = "ragbudget-first-token"
        if self._sock is not None:
            self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if not self._armed:
                return
            self.fired, self._armed = True, False
        with contextlib.suppress(OSError):  # already closed
            assert self._sock is not None
            self._sock.shutdown(socket.SHUT_RDWR)

    def disarm(self) -> bool:
        """The first token came: the timer will not fire. False when it already had."""
        with self._lock:
            was = self._armed
            self._armed = False
        self._timer.cancel()
        return was and not self.fired


def first_token_timeout(base_url: str, waited_ms: float, allowed_ms: float | None,
                        **details: Any) -> BackendError:
    """The error of a stream with no first token by its deadline: ``BackendError`` with code
    ``first_token_timeout`` (``waited_ms`` from the request's send, ``allowed_ms`` the time it
    was given; ``app.fleet`` treats it as the engine dropping the stream before any token)."""
    allowed = f" (allowed {allowed_ms:.0f} ms)" if allowed_ms is not None else ""
    return BackendError(f"remote server {base_url} sent no first token within {waited_ms:.0f} ms"
                        f"{allowed}", code="first_token_timeout", waited_ms=round(waited_ms, 1),
                        allowed_ms=None if allowed_ms is None else round(allowed_ms, 1), **details)
