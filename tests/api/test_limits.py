"""Request limits: each is configurable, refused with 413 or 422 and a code, and its value is allowed.

The OpenAI-compatible chat route answers a request error with 400 (OpenAI's status) instead of 422.

The app here runs with small limits so every boundary is cheap to cross.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from app.api.errors import status_for
from app.api.routes_documents import _write
from app.settings import Settings
from foundation.errors import TooLarge
from retrieval.store import IngestItem
from tests.api.conftest import SENTINEL, KeyedApp, api_settings, start_keyed_app
from tests.api.fakes import CharTokenizer, EchoGenerator

LIMITS = {"max_body_bytes": 20_000, "max_document_bytes": 1000, "max_question_chars": 100, "max_k": 4,
          "retrieval_candidates": 4, "max_new_tokens_limit": 8, "default_max_new_tokens": 8,
          "min_budget_ms": 5.0, "max_budget_ms": 10_000.0, "default_ttft_budget_ms": 1000.0,
          "queue_max": 0}
Q = "What colour is the pump?"
LONG_Q = "x" * 101
HUGE = 2**63


def chat(content: str = Q, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **extra}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory, api_profile: Any) -> Iterator[KeyedApp]:
    app = start_keyed_app(api_settings(tmp_path_factory.mktemp("limited"), **LIMITS), api_profile)
    with app.client:
        r = app.client.post("/v1/documents", json={"id": "pump.txt", "text": SENTINEL},
                            headers=app.headers("admin"))
        assert r.status_code == 201
        yield app
    app.services.close()


def send(app: KeyedApp, method: str, path: str, body: Any = None, params: Any = None,
         headers: dict[str, str] | None = None) -> Any:
    return app.client.request(method, path, json=body, params=params,
                              headers={**app.headers("admin"), **(headers or {})})


REFUSED = [
    # (method, path, json body, query params, extra headers, status, code)
    ("POST", "/v1/documents", {"id": "big", "text": "x" * 1001}, None, None, 413, "too_large"),
    ("POST", "/v1/documents", {"id": "big", "text": "\u00e9" * 501}, None, None, 413, "too_large"),
    ("POST", "/v1/answer", {"question": LONG_Q}, None, None, 413, "question_too_long"),
    ("POST", "/v1/advise", {"question": LONG_Q, "ttft_budget_ms": 500}, None, None, 413, "question_too_long"),
    ("GET", "/v1/advise/curve", None, {"question": LONG_Q}, None, 413, "question_too_long"),
    ("POST", "/v1/chat/completions", chat(LONG_Q), None, None, 413, "question_too_long"),
    ("POST", "/v1/retrieve", {"query": LONG_Q, "k": 1}, None, None, 413, "query_too_long"),
    ("POST", "/v1/answer", {"question": Q, "k_max": 5}, None, None, 422, "invalid_k"),
    ("POST", "/v1/advise", {"question": Q, "ttft_budget_ms": 500, "k_max": 5}, None, None, 422, "invalid_k"),
    ("GET", "/v1/advise/curve", None, {"question": Q, "k_max": 5}, None, 422, "invalid_k"),
    ("POST", "/v1/retrieve", {"query": Q, "k": 5}, None, None, 422, "invalid_k"),
    ("POST", "/v1/retrieve", {"query": Q, "k": 0}, None, None, 422, "invalid_k"),
    ("POST", "/v1/answer", {"question": Q, "max_new_tokens": 9}, None, None, 422, "invalid_max_new_tokens"),
    ("POST", "/v1/chat/completions", chat(max_tokens=9), None, None, 400, "invalid_max_new_tokens"),
    ("POST", "/v1/chat/completions", chat(max_completion_tokens=9), None, None, 400,
     "invalid_max_new_tokens"),
    ("POST", "/v1/answer", {"question": Q, "ttft_budget_ms": 4.9}, None, None, 422, "invalid_budget"),
    ("POST", "/v1/answer", {"question": Q, "ttft_budget_ms": 10_000.5}, None, None, 422, "invalid_budget"),
    ("POST", "/v1/advise", {"question": Q, "ttft_budget_ms": -1}, None, None, 422, "invalid_budget"),
    ("GET", "/v1/advise/curve", None, {"question": Q, "ttft_budget_ms": 0}, None, 422, "invalid_budget"),
    ("POST", "/v1/chat/completions", chat(ttft_budget_ms=1e9), None, None, 400, "invalid_budget"),
    ("POST", "/v1/chat/completions", chat(), None, {"X-TTFT-Budget-Ms": "0"}, 400, "invalid_budget"),
    # out-of-range integers are refused by the schema, never reach the database (no 500)
    ("POST", "/v1/answer", {"question": Q, "revision": HUGE}, None, None, 422, "invalid_request"),
    ("POST", "/v1/advise", {"question": Q, "ttft_budget_ms": 500, "revision": HUGE}, None, None, 422,
     "invalid_request"),
    ("GET", "/v1/advise/curve", None, {"question": Q, "revision": HUGE}, None, 422, "invalid_request"),
    ("POST", "/v1/chat/completions", chat(revision=HUGE), None, None, 400, "invalid_request"),
    ("POST", "/v1/retrieve", {"query": Q, "k": 1, "revision": HUGE}, None, None, 422, "invalid_request"),
    ("POST", "/v1/answer", {"question": Q, "seed": True}, None, None, 422, "invalid_sampling_parameter"),
    ("POST", "/v1/answer", {"question": Q, "seed": 2**53}, None, None, 422, "invalid_sampling_parameter"),
    # an empty question is the same error whether it is "" or blank, on every route
    ("POST", "/v1/answer", {"question": ""}, None, None, 422, "empty_question"),
    ("POST", "/v1/answer", {"question": "   "}, None, None, 422, "empty_question"),
    ("POST", "/v1/advise", {"question": ""}, None, None, 422, "empty_question"),
    ("GET", "/v1/advise/curve", None, {"question": ""}, None, 422, "empty_question"),
    ("POST", "/v1/retrieve", {"query": ""}, None, None, 422, "empty_query"),
    # unknown fields are refused, not silently ignored (a typo would otherwise change nothing)
    ("POST", "/v1/answer", {"question": Q, "ttft_budget": 500}, None, None, 422, "invalid_request"),
    ("POST", "/v1/advise", {"question": Q, "bogus": 1}, None, None, 422, "invalid_request"),
    ("POST", "/v1/retrieve", {"query": Q, "include_text": True}, None, None, 422, "invalid_request"),
]


@pytest.mark.parametrize(("method", "path", "body", "params", "headers", "status", "code"), REFUSED)
def test_limit_is_refused_with_its_status_and_code(limited: KeyedApp, method: str, path: str, body: Any,
                                                   params: Any, headers: Any, status: int, code: str) -> None:
    r = send(limited, method, path, body, params, headers)
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text


ACCEPTED = [
    ("POST", "/v1/documents", {"id": "edge", "text": "y" * 1000}, None),
    ("POST", "/v1/answer", {"question": "q" * 100, "k_max": 4, "max_new_tokens": 8, "ttft_budget_ms": 5},
     None),
    ("POST", "/v1/advise", {"question": Q, "ttft_budget_ms": 10_000, "k_max": 4}, None),
    ("GET", "/v1/advise/curve", None, {"question": Q, "k_max": 4, "ttft_budget_ms": 10_000}),
    ("POST", "/v1/chat/completions", chat(max_tokens=8, ttft_budget_ms=5), None),
    ("POST", "/v1/retrieve", {"query": "q" * 100, "k": 4}, None),
    # the budget is optional everywhere: the configured default applies
    ("POST", "/v1/advise", {"question": Q}, None),
    # OpenAI fields at the value that changes nothing are accepted; `user` is honoured (recorded)
    ("POST", "/v1/chat/completions", chat(presence_penalty=0.0, user="u1"), None),
]


@pytest.mark.parametrize(("method", "path", "body", "params"), ACCEPTED)
def test_a_value_at_the_limit_is_accepted(limited: KeyedApp, method: str, path: str, body: Any,
                                          params: Any) -> None:
    r = send(limited, method, path, body, params)
    assert r.status_code in (200, 201), r.text


def test_body_over_max_body_bytes_is_413_before_parsing(limited: KeyedApp) -> None:
    r = limited.client.post("/v1/answer", content=b"{" + b" " * 20_000 + b"}",
                            headers={**limited.headers("admin"), "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert r.json()["error"]["details"]["limit"] == 20_000


def test_streamed_body_over_max_body_bytes_is_413(limited: KeyedApp) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        yield b'{"question": "'
        for _ in range(25):
            yield b"x" * 1000
        yield b'"}'

    r = limited.client.post("/v1/answer", content=chunks(),
                            headers={**limited.headers("admin"), "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_body_limit_applies_before_authentication(limited: KeyedApp) -> None:
    r = limited.client.post("/v1/answer", content=b"x" * 20_001, headers={"Content-Type": "application/json"})
    assert r.status_code == 413


@pytest.mark.parametrize("raw", [b'{"question": "vacuum", ', b"not json", b'{"question": "a",}'])
def test_body_that_is_not_json_is_400_malformed_body(limited: KeyedApp, raw: bytes) -> None:
    r = limited.client.post("/v1/answer", content=raw, headers={**limited.headers("admin"),
                                                                "Content-Type": "application/json"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "malformed_body"), r.text


def test_unparseable_body_is_a_4xx_with_a_code(limited: KeyedApp) -> None:
    r = limited.client.post("/v1/answer", content=b"\xff\xfe{", headers={**limited.headers("admin"),
                                                                         "Content-Type": "application/json"})
    assert 400 <= r.status_code < 500 and r.json()["error"]["code"] in ("malformed_body", "invalid_request")


def test_batch_over_max_batch_documents_is_413_too_many_documents(limited: KeyedApp,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # POST /v1/documents sends one document; the batch limit guards the shared write path.
    monkeypatch.setattr(limited.services.settings, "max_batch_documents", 1)
    items = [IngestItem("a.txt", text="A."), IngestItem("b.txt", text="B.")]
    with pytest.raises(TooLarge) as exc:
        _write(limited.services, items, [])
    assert exc.value.code == "too_many_documents" and status_for(exc.value) == 413
    with pytest.raises(TooLarge):
        _write(limited.services, items[:1], ["pump.txt"])


def test_full_generation_queue_is_429_with_retry_after(limited: KeyedApp) -> None:
    with limited.client.app.state.pipeline.queue.slot():  # type: ignore[attr-defined]
        for path, body in [("/v1/answer", {"question": Q}), ("/v1/answer", {"question": Q, "stream": True}),
                           ("/v1/chat/completions", chat()), ("/v1/chat/completions", chat(stream=True))]:
            r = send(limited, "POST", path, body)
            assert r.status_code == 429 and r.json()["error"]["code"] == "busy", (path, body)
            assert int(r.headers["Retry-After"]) >= 1
    assert send(limited, "POST", "/v1/answer", {"question": Q}).status_code == 200


def test_second_concurrent_answer_is_429_while_the_model_is_busy(tmp_path: Any, api_profile: Any) -> None:
    gate = threading.Event()
    generator = EchoGenerator(CharTokenizer(), gate=gate)
    app = start_keyed_app(api_settings(tmp_path, queue_max=0), api_profile, generator)
    first: list[Any] = []
    with app.client:
        worker = threading.Thread(target=lambda: first.append(
            app.client.post("/v1/answer", json={"question": Q, "max_new_tokens": 1000},
                            headers=app.headers("copilot"))))
        worker.start()
        try:
            assert generator.started.wait(30), "the first answer never reached the model"
            second = app.client.post("/v1/answer", json={"question": Q}, headers=app.headers("copilot"))
        finally:
            gate.set()
            worker.join(60)
    app.services.close()
    assert first[0].status_code == 200 and first[0].json()["text"] == generator.reply
    # Retry-After: the running answer's predicted time left on the model (its prefill and up to
    # 1000 tokens at the profile's TPOT, as it stood before its first token), rounded up.
    held = first[0].json()
    expected_ms = (held["predicted"]["ttft_p50_ms"]
                   + 999 * api_profile.predict_tpot_ms(held["tokens"]["prompt"]))
    wait_ms = second.json()["error"]["details"]["predicted_wait_ms"]
    assert second.status_code == 429 and wait_ms == pytest.approx(expected_ms, rel=0.01)
    assert second.headers["Retry-After"] == str(math.ceil(wait_ms / 1000)) and wait_ms > 2000
    assert second.headers["x-should-retry"] == "true"


def test_default_limits_are_sane(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RAGBUDGET_"):
            monkeypatch.delenv(name)
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    assert 0 < s.max_document_bytes <= s.max_body_bytes
    assert s.min_budget_ms <= s.default_ttft_budget_ms <= s.max_budget_ms
    assert 1 <= s.default_max_new_tokens <= s.max_new_tokens_limit
    assert 1 <= s.retrieval_candidates <= s.max_k
    assert s.max_question_chars > 0 and s.max_batch_documents >= 1 and s.queue_max >= 1
