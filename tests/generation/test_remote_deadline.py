"""A remote stream's first-token deadline (generation.remote_deadline) at the socket level.

The server here is a raw loopback socket that stalls where a test needs it to: before the
response headers (as a stopped llama.cpp server, which sends its headers with its first
result), or after them (as vLLM, which sends its headers at once). The same fault on a real
llama.cpp server (stopped with SIGSTOP) is tests/engine/test_fleet_llama.py.
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

from foundation.errors import BackendError
from generation.base import GenParams
from generation.remote import RemoteGenerator
from tests.api.fakes import CharTokenizer

HEADERS = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n")


def _chunk(data: str) -> bytes:
    payload = f"data: {data}\n\n".encode()
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"


def _token(text: str) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


class StallServer:
    """Answers every ``POST`` by ``script(conn)``; ``release`` ends any stall."""

    def __init__(self, script: Any) -> None:
        self.script = script
        self.release = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf:
                got = conn.recv(65536)
                if not got:
                    return
                buf += got
            with contextlib.suppress(OSError):
                self.script(self, conn)

    def close(self) -> None:
        self.release.set()
        self.sock.close()


@pytest.fixture()
def serve() -> Iterator[Any]:
    servers: list[StallServer] = []

    def make(script: Any) -> StallServer:
        servers.append(StallServer(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _generator(server: StallServer) -> RemoteGenerator:
    return RemoteGenerator(server.base_url, "m", tokenizer=CharTokenizer(),  # type: ignore[arg-type]
                           mode="completions", context_window=4096, max_running=1)


def _run(gen: RemoteGenerator, allowed_s: float | None) -> tuple[list[str], Any, float]:
    """Stream one answer with a deadline ``allowed_s`` from now; (texts, stats, seconds taken)."""
    stream = gen.stream([1, 2, 3], cached_prefix_ids=None, params=GenParams(max_new_tokens=4))
    t0 = time.perf_counter()
    if allowed_s is not None:
        stream.first_token_deadline_t = t0 + allowed_s
    texts: list[str] = []
    try:
        texts.extend(ev.text for ev in stream)
    finally:
        took = time.perf_counter() - t0
    return texts, stream.stats, took


def _stall_before_headers(server: StallServer, conn: socket.socket) -> None:
    server.release.wait(30)


def _stall_after_headers(server: StallServer, conn: socket.socket) -> None:
    conn.sendall(HEADERS)
    server.release.wait(30)


def _slow_second_token(server: StallServer, conn: socket.socket) -> None:
    conn.sendall(HEADERS + _chunk(_token("The")))
    time.sleep(0.6)  # longer than the whole first-token allowance
    conn.sendall(_chunk(_token(" pump")) + _chunk("[DONE]") + b"0\r\n\r\n")


@pytest.mark.parametrize("script", [_stall_before_headers, _stall_after_headers],
                         ids=["before-headers", "after-headers"])
def test_a_server_that_sends_no_first_token_by_the_deadline_ends_the_stream_with_first_token_timeout(
        serve: Any, script: Any) -> None:
    gen = _generator(serve(script))
    with pytest.raises(BackendError) as err:
        _run(gen, 0.3)
    assert err.value.code == "first_token_timeout"
    assert err.value.details["allowed_ms"] == pytest.approx(300, abs=50)
    assert 250 <= err.value.details["waited_ms"] < 2000  # the deadline, not the 120 s read timeout
    gen.close()


def test_the_deadline_ends_the_stream_within_a_second_of_it_not_at_the_read_timeout(serve: Any) -> None:
    gen = _generator(serve(_stall_after_headers))
    t0 = time.perf_counter()
    with pytest.raises(BackendError, match="no first token"):
        _run(gen, 0.2)
    assert time.perf_counter() - t0 < 1.5
    gen.close()


def test_after_the_first_token_the_deadline_no_longer_applies_and_later_chunks_may_be_slow(
        serve: Any) -> None:
    gen = _generator(serve(_slow_second_token))
    texts, stats, took = _run(gen, 0.3)
    assert texts == ["The", " pump"] and took > 0.5
    assert stats is not None and stats.finish_reason != "error" and stats.first_token_t is not None
    gen.close()


def test_a_deadline_already_due_sends_nothing_and_says_so(serve: Any) -> None:
    hits: list[int] = []

    def count(server: StallServer, conn: socket.socket) -> None:
        hits.append(1)

    gen = _generator(serve(count))
    with pytest.raises(BackendError) as err:
        _run(gen, -0.01)
    assert err.value.code == "first_token_timeout" and err.value.details["sent"] is False
    time.sleep(0.1)
    assert hits == []
    gen.close()


def test_without_a_deadline_a_stalled_server_is_read_until_it_answers(serve: Any) -> None:
    def late(server: StallServer, conn: socket.socket) -> None:
        time.sleep(0.4)
        conn.sendall(HEADERS + _chunk(_token("ok")) + _chunk("[DONE]") + b"0\r\n\r\n")

    gen = _generator(serve(late))
    texts, _stats, took = _run(gen, None)
    assert texts == ["ok"] and took >= 0.4
    gen.close()
