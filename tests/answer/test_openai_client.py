"""The official ``openai`` client, unmodified, against ragbudget's ``/v1/chat/completions`` on loopback."""

from __future__ import annotations

from typing import Any

import pytest

from tests.answer.conftest import BUDGET_MS, QUESTION, receipt_body

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _create(client: Any, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="ragbudget", max_tokens=MAX_TOKENS,
        messages=[{"role": "system", "content": "Answer in one short paragraph."},
                  {"role": "user", "content": QUESTION}],
        extra_body={"ttft_budget_ms": BUDGET_MS}, **kw)


def test_openai_client_non_stream_answer_has_usage_and_receipt(client, answer_services):
    raw = client.chat.completions.with_raw_response.create(
        model="ragbudget", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": QUESTION}],
        extra_body={"ttft_budget_ms": BUDGET_MS})
    resp = raw.parse()
    text = resp.choices[0].message.content
    assert text and text.strip()
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason in ("stop", "length")
    u = resp.usage
    assert u is not None and u.prompt_tokens > 0 and 1 <= u.completion_tokens <= MAX_TOKENS
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens > 0
    extra = resp.model_extra["ragbudget"]
    assert extra["receipt_id"].startswith("rcpt_")
    assert raw.headers["x-ragbudget-receipt-id"] == extra["receipt_id"]
    body = receipt_body(answer_services, extra["receipt_id"])
    assert body["output"]["text"] == text and body["status"] == "ok"
    assert body["prompt"]["prompt_tokens"] == u.prompt_tokens


def test_openai_client_stream_with_include_usage(client, answer_services):
    stream = _create(client, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    text = "".join(c.choices[0].delta.content for c in content)
    assert text.strip()
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert 1 <= last.usage.completion_tokens <= MAX_TOKENS
    assert last.usage.prompt_tokens > last.usage.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    receipt_id = finals[0].model_extra["ragbudget"]["receipt_id"]
    body = receipt_body(answer_services, receipt_id)
    assert body["output"]["text"] == text
    assert body["output"]["output_tokens"] == last.usage.completion_tokens


def test_openai_client_stream_and_non_stream_agree(client):
    whole = _create(client).choices[0].message.content
    parts = "".join(c.choices[0].delta.content or "" for c in _create(client, stream=True) if c.choices)
    assert parts == whole
