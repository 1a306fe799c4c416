"""A failure after the stream started ends it with an error event and the terminator, never a silent cut.

The fault is injected inside the real engine: its forward pass raises on the
third decode step (prefill, two decode steps, then the failure), so three tokens
reach the client before the backend fails.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.answer.conftest import BUDGET_MS, QUESTION, receipt_body, sse_events, wait_idle

pytestmark = pytest.mark.slow

GOOD_FORWARDS = 3


@pytest.fixture
def failing_model(answer_services: Any, live_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The engine's forward fails on the answer's third decode step (restored afterwards).

    Prefill runs in chunks (several forwards) and gives the first token; two decode
    steps give two more; the next forward raises: ``GOOD_FORWARDS`` tokens in all.
    """
    wait_idle(live_server.pipeline)
    engine = answer_services.generator.engine
    real = engine.runner.forward
    calls = {"n": 0}

    def forward(ids: list[int], positions: list[int], keep: list[int], ctx: Any) -> Any:
        if all(seg.n == 1 for seg in ctx.segments):  # a decode-only step
            calls["n"] += 1
            if calls["n"] >= GOOD_FORWARDS:
                raise RuntimeError("simulated device fault")
        return real(ids, positions, keep, ctx)

    monkeypatch.setattr(engine.runner, "forward", forward)
    return calls


def test_answer_stream_failure_sends_error_event_then_done_and_a_failed_receipt(
        failing_model, live_server, answer_services):
    with httpx.stream("POST", f"{live_server.base_url}/v1/answer", timeout=120,
                      json={"question": QUESTION, "ttft_budget_ms": BUDGET_MS, "max_new_tokens": 16,
                            "stream": True}) as r:
        assert r.status_code == 200
        events = list(sse_events(r.iter_lines()))
    names = [n for n, _ in events]
    assert names == ["token"] * GOOD_FORWARDS + ["error", "message"]
    assert events[-1] == ("message", "[DONE]")
    summary = json.loads(events[-2][1])
    assert summary["status"] == "failed"
    assert summary["error"]["code"] == "backend_error"
    assert "simulated device fault" in summary["error"]["message"]
    body = receipt_body(answer_services, summary["receipt_id"])
    assert body["status"] == "failed" and body["error"]["code"] == "backend_error"
    assert body["output"]["output_tokens"] == GOOD_FORWARDS == len(body["output"]["token_ids"])
    assert body["output"]["text"] == "".join(json.loads(d)["text"] for n, d in events if n == "token")


def test_chat_stream_failure_sends_error_chunk_then_done(failing_model, live_server, answer_services):
    with httpx.stream("POST", f"{live_server.base_url}/v1/chat/completions", timeout=120,
                      json={"model": "ragbudget", "stream": True, "max_tokens": 16,
                            "ttft_budget_ms": BUDGET_MS,
                            "messages": [{"role": "user", "content": QUESTION}]}) as r:
        assert r.status_code == 200
        data = [d for _, d in sse_events(r.iter_lines())]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    errors = [c for c in chunks if "error" in c]
    assert len(errors) == 1 and "simulated device fault" in errors[0]["error"]["message"]
    content = [c for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content")]
    assert len(content) == GOOD_FORWARDS
    receipt_id = chunks[-1]["ragbudget"]["receipt_id"]
    assert chunks[-1]["ragbudget"]["status"] == "failed"
    assert receipt_body(answer_services, receipt_id)["status"] == "failed"


def test_model_serves_again_after_a_failed_answer(failing_model, live_server, monkeypatch):
    monkeypatch.undo()
    wait_idle(live_server.pipeline)
    r = httpx.post(f"{live_server.base_url}/v1/answer", timeout=120,
                   json={"question": QUESTION, "ttft_budget_ms": BUDGET_MS, "max_new_tokens": 4})
    assert r.status_code == 200 and r.json()["status"] == "ok"
