"""The receipt and the plan travel with the answer: response id, headers and the ``ragbudget`` field.

A client goes from what it keeps of a response (the OpenAI response id, the
``X-Ragbudget-Receipt-Id`` header) to ``GET /v1/receipts/{id}``, streamed or not, through the
official ``openai`` client and raw HTTP (httpx); the plan headers (chosen k, binding, budget,
predicted TTFT) say what the budget did before the first token (fake model, real pipeline).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from app.api import answer_headers as H
from tests.api.conftest import KeyedApp, api_settings, start_keyed_app
from tests.api.fakes import EchoGenerator
from tests.retrieval.fakes import HashingEmbedder

REPLY = "The pump is painted vermilion."
DOCS = {"pump.txt": "The circulation pump is painted vermilion and draws 3 kW at full load.",
        "wal.txt": "max_wal_senders sets the maximum number of concurrent WAL sender processes.",
        "vacuum.txt": "Autovacuum removes dead tuples; autovacuum_naptime sets the delay between runs."}
Q = "What colour is the pump?"
WIDE_MS = 60_000.0  # every candidate fits
NARROW_MS = 1.0  # the least budget accepted: nothing fits, not even k = 0


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, api_profile: Any) -> Iterator[KeyedApp]:
    root = tmp_path_factory.mktemp("headers")
    keyed = start_keyed_app(api_settings(root, retrieval_candidates=3), api_profile)
    keyed.services.__dict__["generator"] = EchoGenerator(keyed.services.tokenizer, reply=REPLY)
    keyed.services.__dict__["embedder"] = HashingEmbedder(dim=1024)
    with keyed.client:
        for doc_id, text in DOCS.items():
            r = keyed.client.post("/v1/documents", json={"id": doc_id, "text": text},
                                  headers=keyed.headers("admin"))
            assert r.status_code == 201, r.text
        yield keyed
    keyed.services.close()


@pytest.fixture(scope="module")
def oai(app: KeyedApp) -> openai.OpenAI:
    """The official client, unmodified, over the app's in-process HTTP transport."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key=app.keys["copilot"],
                         http_client=app.client, max_retries=0)


def fetch_receipt(app: KeyedApp, receipt_id: str) -> dict[str, Any]:
    """``GET /v1/receipts/{id}`` as an operator; the receipt's JSON."""
    r = app.client.get(f"/v1/receipts/{receipt_id}", headers=app.headers("operator"))
    assert r.status_code == 200, r.text
    return r.json()["receipt"]  # type: ignore[no-any-return]


def receipt_id_of_response_id(response_id: str) -> str:
    assert response_id.startswith("chatcmpl-rcpt_"), response_id
    return response_id.removeprefix("chatcmpl-")


def sse_data(text: str) -> list[Any]:
    return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


def chat_body(budget_ms: float = WIDE_MS, **extra: Any) -> dict[str, Any]:
    return {"model": "ragbudget", "messages": [{"role": "user", "content": Q}],
            "ttft_budget_ms": budget_ms, "max_tokens": 6, **extra}


def assert_plan_headers_match(headers: Any, extra: dict[str, Any]) -> None:
    """The plan headers say what the ``ragbudget`` field says."""
    assert headers[H.RECEIPT_ID] == extra["receipt_id"]
    assert int(headers[H.CHOSEN_K]) == extra["chosen_k"]
    assert headers[H.BINDING] == extra["binding"]
    assert float(headers[H.BUDGET_MS]) == pytest.approx(extra["ttft_budget_ms"], abs=0.05)
    assert float(headers[H.PREDICTED_P50_MS]) == pytest.approx(extra["predicted"]["ttft_p50_ms"], abs=0.05)
    assert float(headers[H.PREDICTED_P95_MS]) == pytest.approx(extra["predicted"]["ttft_p95_ms"], abs=0.05)


# --- the openai client ----------------------------------------------------------------------
def test_openai_client_non_streamed_response_id_and_header_lead_to_the_receipt(
        app: KeyedApp, oai: openai.OpenAI) -> None:
    raw = oai.chat.completions.with_raw_response.create(
        model="ragbudget", max_tokens=6, messages=[{"role": "user", "content": Q}])
    completion = raw.parse()
    receipt_id = receipt_id_of_response_id(completion.id)
    assert raw.headers["x-ragbudget-receipt-id"] == receipt_id
    receipt = fetch_receipt(app, receipt_id)
    assert receipt["id"] == receipt_id
    assert receipt["output"]["text"] == completion.choices[0].message.content


def test_openai_client_streamed_response_id_and_header_lead_to_the_receipt(
        app: KeyedApp, oai: openai.OpenAI) -> None:
    raw = oai.chat.completions.with_raw_response.create(
        model="ragbudget", max_tokens=6, stream=True, messages=[{"role": "user", "content": Q}])
    chunks = list(raw.parse())
    ids = {c.id for c in chunks}
    assert len(ids) == 1  # every chunk carries the same id
    receipt_id = receipt_id_of_response_id(ids.pop())
    assert raw.headers["x-ragbudget-receipt-id"] == receipt_id
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert fetch_receipt(app, receipt_id)["output"]["text"] == text


# --- raw HTTP (httpx) -----------------------------------------------------------------------
def test_raw_http_stream_sends_receipt_and_plan_headers_before_the_body(app: KeyedApp) -> None:
    with app.client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True),
                           headers=app.headers("copilot")) as r:
        assert r.status_code == 200
        headers = r.headers
        chunks = sse_data(r.read().decode())
    final = next(c for c in chunks if c != "[DONE]" and c["choices"] and c["choices"][0]["finish_reason"])
    extra = final["ragbudget"]
    assert_plan_headers_match(headers, extra)
    assert H.TTFT_MS not in headers  # measured only after the headers went out: in the final chunk
    assert extra["timings"]["ttft_ms"] > 0
    assert {c["id"] for c in chunks if c != "[DONE]"} == {"chatcmpl-" + extra["receipt_id"]}
    assert fetch_receipt(app, headers[H.RECEIPT_ID])["plan"]["chosen_k"] == extra["chosen_k"]


def test_raw_http_non_streamed_headers_carry_plan_and_measured_ttft(app: KeyedApp) -> None:
    r = app.client.post("/v1/chat/completions", json=chat_body(), headers=app.headers("copilot"))
    assert r.status_code == 200, r.text
    extra = r.json()["ragbudget"]
    assert_plan_headers_match(r.headers, extra)
    assert float(r.headers[H.TTFT_MS]) == pytest.approx(extra["timings"]["ttft_ms"], abs=0.05)
    assert r.json()["id"] == "chatcmpl-" + r.headers[H.RECEIPT_ID]
    receipt = fetch_receipt(app, r.headers[H.RECEIPT_ID])
    assert receipt["timings"]["ttft_ms"] == pytest.approx(extra["timings"]["ttft_ms"])


@pytest.mark.parametrize("stream", [False, True])
def test_answer_route_sends_receipt_and_plan_headers(app: KeyedApp, stream: bool) -> None:
    body = {"question": Q, "ttft_budget_ms": WIDE_MS, "max_new_tokens": 6, "stream": stream}
    r = app.client.post("/v1/answer", json=body, headers=app.headers("copilot"))
    assert r.status_code == 200, r.text
    if stream:
        lines = r.text.splitlines()
        final = json.loads(lines[lines.index("event: final") + 1][6:])
    else:
        final = r.json()
    assert_plan_headers_match(r.headers, final)
    assert (H.TTFT_MS in r.headers) is not stream
    assert fetch_receipt(app, r.headers[H.RECEIPT_ID])["output"]["text"] == final["text"]


# --- an answer without context looks different from one with context -----------------------
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_planned_without_context_says_so_in_its_headers(app: KeyedApp, stream: bool) -> None:
    narrow = app.client.post("/v1/chat/completions", json=chat_body(NARROW_MS, stream=stream),
                             headers=app.headers("copilot"))
    wide = app.client.post("/v1/chat/completions", json=chat_body(WIDE_MS, stream=stream),
                           headers=app.headers("copilot"))
    assert narrow.status_code == wide.status_code == 200
    assert (narrow.headers[H.CHOSEN_K], narrow.headers[H.BINDING]) == ("0", "nothing_fits")
    assert int(wide.headers[H.CHOSEN_K]) > 0 and wide.headers[H.BINDING] != "nothing_fits"
    for r in (narrow, wide):
        receipt = fetch_receipt(app, r.headers[H.RECEIPT_ID])
        assert str(receipt["plan"]["chosen_k"]) == r.headers[H.CHOSEN_K]
        assert receipt["plan"]["binding"] == r.headers[H.BINDING]
