"""Chunk texts and receipt bodies reach operators and admins only.

The app holds one document whose text is :data:`SENTINEL`; every copilot
response that used it (retrieval, advice, answers, chat) must cite it without
carrying its text.
"""

from __future__ import annotations

import pytest

from tests.api.conftest import SENTINEL, KeyedApp

QUESTION = "What colour is the circulation pump?"


def test_copilot_retrieval_hits_carry_no_text(secured: KeyedApp) -> None:
    r = secured.client.post("/v1/retrieve", json={"query": QUESTION, "k": 1},
                            headers=secured.headers("copilot"))
    assert r.status_code == 200
    hits = r.json()["hits"]
    assert [h["document_id"] for h in hits] == ["pump.txt"]
    assert "text" not in hits[0] and SENTINEL not in r.text


@pytest.mark.parametrize("who", ["operator", "admin"])
def test_operator_and_admin_retrieval_hits_carry_the_chunk_text(secured: KeyedApp, who: str) -> None:
    r = secured.client.post("/v1/retrieve", json={"query": QUESTION, "k": 1}, headers=secured.headers(who))
    assert r.status_code == 200 and r.json()["hits"][0]["text"] == SENTINEL


CITED = '"document_id":"pump.txt"'


@pytest.mark.parametrize(("method", "path", "body", "used"), [
    ("POST", "/v1/answer", {"question": QUESTION, "ttft_budget_ms": 60_000}, CITED),
    ("POST", "/v1/answer", {"question": QUESTION, "ttft_budget_ms": 60_000, "stream": True}, CITED),
    ("POST", "/v1/advise", {"question": QUESTION, "ttft_budget_ms": 60_000}, CITED),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}],
                                      "ttft_budget_ms": 60_000}, CITED),
    ("POST", "/v1/completions", {"prompt": QUESTION, "ttft_budget_ms": 60_000}, CITED),
    ("GET", "/v1/advise/curve", None, '"chosen_k":1,'),
])
def test_copilot_answers_cite_the_chunk_without_its_text(secured: KeyedApp, method: str, path: str,
                                                        body: dict | None, used: str) -> None:  # type: ignore[type-arg]
    kwargs = {"json": body} if body is not None else {"params": {"question": QUESTION,
                                                                  "ttft_budget_ms": 60_000}}
    r = secured.client.request(method, path, headers=secured.headers("copilot"), **kwargs)
    assert r.status_code == 200, r.text
    assert used in r.text.replace(" ", "")  # the chunk was used (cited, listed or planned) ...
    assert SENTINEL not in r.text and "vermilion" not in r.text  # ... but its text never shown


def test_copilot_cannot_read_or_replay_a_real_receipt(secured: KeyedApp) -> None:
    r = secured.client.post("/v1/answer", json={"question": QUESTION}, headers=secured.headers("copilot"))
    receipt_id = r.json()["receipt_id"]
    assert receipt_id
    copilot = secured.headers("copilot")
    assert secured.client.get(f"/v1/receipts/{receipt_id}", headers=copilot).status_code == 403
    assert secured.client.post(f"/v1/receipts/{receipt_id}/replay", headers=copilot).status_code == 403
    assert secured.client.get("/v1/receipts", headers=copilot).status_code == 403
    body = secured.client.get(f"/v1/receipts/{receipt_id}", headers=secured.headers("operator")).json()
    assert body["receipt"]["question"] == QUESTION and body["receipt"]["id"] == receipt_id


def test_copilot_cannot_read_document_text_but_operator_can(secured: KeyedApp) -> None:
    r = secured.client.get("/v1/documents/pump.txt", headers=secured.headers("copilot"))
    assert r.status_code == 403 and SENTINEL not in r.text
    r = secured.client.get("/v1/documents/pump.txt", headers=secured.headers("operator"))
    assert r.status_code == 200 and r.json()["current"]["text"] == SENTINEL


def test_copilot_sees_revision_hashes_but_no_text(secured: KeyedApp) -> None:
    r = secured.client.get("/v1/revisions/1", headers=secured.headers("copilot"))
    assert r.status_code == 200 and r.json()["documents"][0]["document_id"] == "pump.txt"
    assert SENTINEL not in r.text
