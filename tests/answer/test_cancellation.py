"""A client that closes a streaming answer mid-way stops its generation and frees the model.

The server is real (uvicorn on loopback), so the disconnect is a real closed
socket. Proof that generation stopped: the decode loop itself reports
``cancelled`` after far fewer than ``max_new_tokens`` tokens, and the answer's
receipt says ``cancelled`` with the tokens that were actually generated. A client
that hangs up while its request waits in the queue leaves the queue at once and
its answer is recorded as cancelled with no tokens.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.answer.conftest import BUDGET_MS, QUESTION, receipt_body, sse_events, wait_idle

pytestmark = pytest.mark.slow

MAX_NEW = 200
READ_TOKENS = 3


def _new_receipt_after(services: Any, seq: int, timeout_s: float = 60.0) -> Any:
    from receipts.chain import head

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = head(services.engine)
        if h is not None and h.seq > seq:
            return h
        time.sleep(0.05)
    raise AssertionError("no receipt was written for the cancelled answer")


@pytest.fixture(scope="module")
def cancelled(live_server: Any, answer_services: Any) -> dict[str, Any]:
    """Stream an answer, read a few token events, close the connection; what the server did."""
    from receipts.chain import head

    wait_idle(live_server.pipeline)
    before = head(answer_services.engine)
    seq = before.seq if before else 0
    read: list[str] = []
    gen = answer_services.generator
    streams: list[Any] = []  # the streams the server starts (their stats once they end)
    started = gen.stream
    gen.stream = lambda *a, **kw: streams.append(started(*a, **kw)) or streams[-1]
    try:
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", f"{live_server.base_url}/v1/answer",
                json={"question": QUESTION, "ttft_budget_ms": BUDGET_MS, "max_new_tokens": MAX_NEW,
                      "stream": True}) as r:
            assert r.status_code == 200
            for name, data in sse_events(r.iter_lines()):
                assert name == "token", (name, data)
                read.append(json.loads(data)["text"])
                if len(read) == READ_TOKENS:
                    break
        stored = _new_receipt_after(answer_services, seq)
        wait_idle(live_server.pipeline)
    finally:
        del gen.stream  # the class's own again
    assert len(streams) == 1
    stats = streams[0].stats
    assert stats is not None
    return {"read": read, "receipt": receipt_body(answer_services, stored.id),
            "finish_reason": stats.finish_reason, "generated": stats.output_tokens,
            "stats_ids": list(stats.output_token_ids)}


def test_disconnect_stops_the_decode_loop_well_before_max_new_tokens(cancelled):
    assert cancelled["finish_reason"] == "cancelled"
    assert READ_TOKENS <= cancelled["generated"] < MAX_NEW // 4


def test_cancelled_answer_receipt_has_status_and_the_generated_tokens(cancelled, answer_services):
    body = cancelled["receipt"]
    out = body["output"]
    assert body["status"] == "cancelled"
    assert READ_TOKENS <= out["output_tokens"] < MAX_NEW // 4
    assert out["token_ids"] == cancelled["stats_ids"]
    assert out["output_tokens"] == len(out["token_ids"])
    assert out["text"].startswith("".join(cancelled["read"]))
    assert answer_services.tokenizer.decode(out["token_ids"]).startswith(out["text"])
    assert body["prompt"]["cached_tokens"] > 0  # the scaffold came from the prefix cache


def test_cancelled_answer_frees_the_queue_for_the_next_request(cancelled, live_server):
    q = live_server.pipeline.queue
    assert not q.busy and q.depth == 0
    r = httpx.post(f"{live_server.base_url}/v1/answer",
                   json={"question": QUESTION, "ttft_budget_ms": BUDGET_MS, "max_new_tokens": 4},
                   timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["tokens"]["output"] >= 1


def test_cancelled_answers_are_counted_in_metrics(cancelled, live_server):
    text = httpx.get(f"{live_server.base_url}/metrics", timeout=10).text
    line = [ln for ln in text.splitlines() if ln.startswith('ragbudget_answers_total{status="cancelled"}')]
    assert line and float(line[0].split()[-1]) >= 1


def _raw_answer_request(base_url: str, body: dict[str, Any]) -> Any:
    """Send ``POST /v1/answer`` on a bare socket (so the test can hang up whenever it likes)."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(base_url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    sock.sendall(b"POST /v1/answer HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (u.netloc.encode(), len(payload), payload))
    return sock


def test_client_that_leaves_while_queued_frees_its_place(live_server, answer_services, monkeypatch):
    from receipts.chain import head, list_receipts

    wait_idle(live_server.pipeline)
    before = head(answer_services.engine)
    seq = before.seq if before else 0
    # One slot: the running answer takes it, so the second request must queue (with the
    # engine's default of several slots it would simply join the running batch).
    monkeypatch.setattr(answer_services.generator.engine, "max_running", 1)
    q = live_server.pipeline.queue
    body = {"question": QUESTION, "ttft_budget_ms": BUDGET_MS, "max_new_tokens": MAX_NEW, "stream": True}
    # The engine decodes ahead of a client that does not read, so the running answer must be
    # long enough not to end (and hand its slot to the waiting one) during the test: 1000 tokens.
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", f"{live_server.base_url}/v1/answer",
            json={**body, "max_new_tokens": 1000}) as running:
        events = sse_events(running.iter_lines())  # kept referenced: dropping it would hang up
        assert next(events)[0] == "token"  # the first answer now holds the model
        waiting = _raw_answer_request(live_server.base_url, body)
        deadline = time.monotonic() + 30
        while q.depth != 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.01)
        waiting.close()
        deadline = time.monotonic() + 30
        while q.depth != 0:
            assert time.monotonic() < deadline, "the queued request kept its place after hanging up"
            time.sleep(0.01)
    wait_idle(live_server.pipeline)
    # A receipt is appended after the answer leaves the queue: wait for both, not for the queue.
    _new_receipt_after(answer_services, seq + 1)
    page, _ = list_receipts(answer_services.engine, limit=2)  # newest first
    running_body, queued_body = (receipt_body(answer_services, r["id"]) for r in page)
    # The queued answer was recorded first: it left while the other still held the model.
    assert queued_body["status"] == "cancelled" and queued_body["output"]["output_tokens"] == 0
    assert queued_body["timings"]["ttft_ms"] is None and queued_body["output"]["text"] == ""
    assert running_body["status"] == "cancelled" and running_body["output"]["output_tokens"] >= 1
