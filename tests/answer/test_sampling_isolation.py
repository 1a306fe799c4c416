"""Sampling parameters over HTTP: out-of-range values refused before any work, and an extreme
value inside the range neither fails its own answer nor touches a greedy answer beside it.

Live server, real SmolLM2, real pages (:mod:`tests.answer.conftest`).
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import httpx
import pytest

from tests.answer.conftest import BUDGET_MS, QUESTION, receipt_body, wait_idle

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
OTHER_QUESTION = "What does VACUUM ANALYZE do?"


def _receipt_count(services: Any) -> int:
    from receipts.chain import list_receipts

    page, _ = list_receipts(services.engine, limit=1000)
    return len(page)


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    # json.dumps writes NaN and Infinity as JavaScript does; clients that send them exist.
    return httpx.post(url, timeout=300, content=json.dumps(body),
                      headers={"Content-Type": "application/json"})


def _chat(base_url: str, question: str, **fields: Any) -> httpx.Response:
    return _post(f"{base_url}/v1/chat/completions", {
        "model": "ragbudget", "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS, "ttft_budget_ms": BUDGET_MS, **fields})


def _answer(base_url: str, question: str, **fields: Any) -> httpx.Response:
    return _post(f"{base_url}/v1/answer", {
        "question": question, "max_new_tokens": MAX_TOKENS, "ttft_budget_ms": BUDGET_MS, **fields})


def test_a_tiny_temperature_beside_a_greedy_answer_leaves_both_ok(live_server: Any,
                                                                  answer_services: Any) -> None:
    """temperature 1e-40 is inside [0, 2] (vLLM accepts it too) but overflows float32 in
    ``softmax(logits / T)``: the sampler used to raise there, and that ended every answer in
    the step. Now both answers end ok, and the greedy one is the text it has alone."""
    base = live_server.base_url
    wait_idle(live_server.pipeline)
    alone = _chat(base, QUESTION)
    assert alone.status_code == 200, alone.text
    engine = answer_services.generator.engine
    engine.peak_rows_answers = 0
    results: dict[str, httpx.Response] = {}
    gate = threading.Barrier(2)

    def ask(name: str) -> None:
        gate.wait()
        results[name] = (_chat(base, QUESTION) if name == "greedy"
                         else _answer(base, OTHER_QUESTION, temperature=1e-40, seed=7))

    threads = [threading.Thread(target=ask, args=(n,)) for n in ("greedy", "tiny")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_idle(live_server.pipeline)
    assert engine.peak_rows_answers >= 2, "the two answers never shared an engine step"
    greedy, tiny = results["greedy"], results["tiny"]
    assert greedy.status_code == 200 and tiny.status_code == 200, (greedy.text, tiny.text)
    assert greedy.json()["choices"][0]["message"]["content"] == \
        alone.json()["choices"][0]["message"]["content"]
    assert receipt_body(answer_services, greedy.json()["ragbudget"]["receipt_id"])["status"] == "ok"
    assert tiny.json()["status"] == "ok" and tiny.json()["tokens"]["output"] > 0
    body = receipt_body(answer_services, tiny.json()["receipt_id"])
    assert body["status"] == "ok" and body["generator"]["params"]["temperature"] == 1e-40


BAD_FIELDS = [({"temperature": -0.5}, "temperature"), ({"temperature": 2.5}, "temperature"),
              ({"temperature": math.nan}, "temperature"), ({"top_p": 0.0}, "top_p"),
              ({"top_p": 1.5}, "top_p"), ({"seed": -1}, "seed")]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS, ids=[repr(f) for f, _ in BAD_FIELDS])
def test_out_of_range_sampling_parameters_are_refused_on_both_routes_before_any_work(
        live_server: Any, answer_services: Any, fields: dict[str, Any], param: str) -> None:
    wait_idle(live_server.pipeline)
    engine = answer_services.generator.engine
    steps, receipts = engine.steps, _receipt_count(answer_services)
    chat = _chat(live_server.base_url, QUESTION, **fields)
    answer = _answer(live_server.base_url, QUESTION, **fields)
    assert chat.status_code == 400 and chat.json()["error"]["param"] == param, chat.text
    assert chat.json()["error"]["code"] == "invalid_sampling_parameter"
    assert answer.status_code == 422 and answer.json()["error"]["code"] == "invalid_sampling_parameter"
    assert param in answer.json()["error"]["message"]
    assert (engine.steps, _receipt_count(answer_services)) == (steps, receipts)


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"seed": 2**53}, "seed"), ({"max_new_tokens": 4, "temperature": -1.0},
                                                           "temperature")])
def test_the_pipeline_refuses_bad_sampling_parameters_before_retrieval(
        live_server: Any, answer_services: Any, monkeypatch: pytest.MonkeyPatch,
        fields: dict[str, Any], param: str) -> None:
    """Callers that do not go through the HTTP schemas (the CLI, library use) get the same
    ranges: refused with ``invalid_sampling_parameter`` before retrieval, the queue or the
    model, and no receipt."""
    from app.answering.state import AnswerRequest
    from foundation.errors import InvalidInput

    pipeline = live_server.pipeline
    wait_idle(pipeline)
    retrieved: list[str] = []
    real = answer_services.retriever.retrieve
    monkeypatch.setattr(answer_services.retriever, "retrieve",
                        lambda *a, **kw: retrieved.append("called") or real(*a, **kw))
    engine = answer_services.generator.engine
    steps, receipts = engine.steps, _receipt_count(answer_services)
    with pytest.raises(InvalidInput) as err:
        list(pipeline.stream(AnswerRequest(question=QUESTION, ttft_budget_ms=BUDGET_MS, **fields)))
    assert err.value.code == "invalid_sampling_parameter" and err.value.details["param"] == param
    assert retrieved == [] and (engine.steps, _receipt_count(answer_services)) == (steps, receipts)
