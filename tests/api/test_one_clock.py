"""One clock: an answer's TTFT starts when the server first sees the HTTP request.

Authentication, body parsing and validation run inside the measured TTFT (and
inside the overhead the plan subtracts from the budget); the key check is
reported apart as ``auth_ms`` in the answer, the receipt and the metrics.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

import app.api.deps as deps
from receipts.chain import get_receipt
from tests.api.conftest import SENTINEL, KeyedApp, api_settings, start_keyed_app

SLOW_AUTH_S = 0.25


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, api_profile: Any) -> Iterator[KeyedApp]:
    app = start_keyed_app(api_settings(tmp_path_factory.mktemp("clock"), default_max_new_tokens=4),
                          api_profile)
    with app.client:
        r = app.client.post("/v1/documents", json={"id": "pump.txt", "text": SENTINEL},
                            headers=app.headers("admin"))
        assert r.status_code == 201, r.text
        yield app
    app.services.close()


@pytest.fixture
def slow_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    real = deps.authenticate

    def slow(engine: Any, presented: str | None) -> Any:
        time.sleep(SLOW_AUTH_S)
        return real(engine, presented)

    monkeypatch.setattr(deps, "authenticate", slow)


def test_a_slow_key_check_shows_up_in_ttft_and_overhead(keyed: KeyedApp, slow_auth: None) -> None:
    r = keyed.client.post("/v1/answer", json={"question": "What colour is the pump?",
                                              "ttft_budget_ms": 5000},
                          headers=keyed.headers("copilot"))
    assert r.status_code == 200, r.text
    a = r.json()
    t = a["timings"]
    slow_ms = SLOW_AUTH_S * 1000.0
    assert t["auth_ms"] >= slow_ms
    assert t["ttft_ms"] >= t["auth_ms"] + t["queue_ms"] + t["retrieval_ms"]
    assert t["overhead_ms"] >= slow_ms  # the plan saw the time the key check took
    assert a["predicted"]["overhead_ms"] >= slow_ms
    assert t["prefill_ms"] is not None and t["prefill_ms"] <= t["ttft_ms"] - t["auth_ms"]
    assert t["planning_ms"] is not None
    body = get_receipt(keyed.services.engine, a["receipt_id"])
    assert body["timings"]["auth_ms"] == t["auth_ms"]
    assert body["timings"]["prefill_ms"] == t["prefill_ms"]


def test_advise_counts_the_key_check_in_its_overhead(keyed: KeyedApp, slow_auth: None) -> None:
    r = keyed.client.post("/v1/advise", json={"question": "What colour is the pump?",
                                              "ttft_budget_ms": 5000},
                          headers=keyed.headers("copilot"))
    assert r.status_code == 200, r.text
    t = r.json()["timings"]
    assert t["auth_ms"] >= SLOW_AUTH_S * 1000.0
    assert t["overhead_ms"] >= t["auth_ms"]


def test_openai_route_counts_the_key_check(keyed: KeyedApp, slow_auth: None) -> None:
    r = keyed.client.post("/v1/chat/completions",
                          json={"model": keyed.services.generator.identity["model_id"],
                                "messages": [{"role": "user", "content": "What colour is the pump?"}],
                                "ttft_budget_ms": 5000},
                          headers=keyed.headers("copilot"))
    assert r.status_code == 200, r.text
    t = r.json()["ragbudget"]["timings"]
    assert t["auth_ms"] >= SLOW_AUTH_S * 1000.0
    assert t["ttft_ms"] >= t["auth_ms"]


def test_metrics_keep_the_key_check_apart(keyed: KeyedApp) -> None:
    r = keyed.client.post("/v1/answer", json={"question": "pump colour", "ttft_budget_ms": 5000},
                          headers=keyed.headers("copilot"))
    assert r.status_code == 200
    text = keyed.client.get("/metrics", headers=keyed.headers("admin")).text
    for name in ("ragbudget_auth_ms_count", "ragbudget_prefill_ms_count", "ragbudget_planning_ms_count"):
        assert name in text


def test_ttft_counts_from_the_middleware_stamp_not_the_handler(keyed: KeyedApp,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Time spent between the middleware and the handler (here a slow body read) is inside TTFT."""
    import app.api.clock as clock

    stamps: list[float] = []
    real = clock.ArrivalClockMiddleware.__call__

    async def spy(self: Any, scope: Any, receive: Any, send: Any) -> None:
        await real(self, scope, receive, send)
        stamps.append(scope["state"][clock.ARRIVAL_KEY])

    monkeypatch.setattr(clock.ArrivalClockMiddleware, "__call__", spy)
    t0 = time.perf_counter()
    r = keyed.client.post("/v1/answer", json={"question": "pump colour", "ttft_budget_ms": 5000},
                          headers=keyed.headers("copilot"))
    assert r.status_code == 200
    assert len(stamps) == 1 and t0 <= stamps[0]
    ttft = r.json()["timings"]["ttft_ms"]
    assert ttft <= (time.perf_counter() - t0) * 1000.0
