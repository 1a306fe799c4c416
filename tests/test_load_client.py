"""The load benchmark's client: a closed-loop client refused fast waits the refusal's Retry-After.

A two-route stand-in for the API (FastAPI, served by the benchmark's own :class:`Server` on
loopback): every ``POST /v1/answer`` is refused with 503 ``budget_unreachable`` and
``Retry-After: 3``. The client's sleeps are recorded (``time.sleep`` replaced in the module),
so nothing here waits on the wall clock.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from benchmarks import load_http


def _refusing_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/answer")
    def answer() -> JSONResponse:
        return JSONResponse(status_code=503, headers={"Retry-After": "3"}, content={"error": {
            "code": "budget_unreachable", "message": "even k=0 is over budget",
            "details": {"predicted_ttft_ms": 900.0, "where": "arrival"}}})

    return app


@pytest.fixture
def server() -> Any:
    s = load_http.Server(_refusing_app())
    yield s
    s.stop()


@pytest.mark.parametrize("retry_immediately", [False, True])
def test_a_refused_closed_loop_client_waits_retry_after(server: Any, monkeypatch: pytest.MonkeyPatch,
                                                       retry_immediately: bool) -> None:
    waits: list[float] = []
    monkeypatch.setattr(load_http.time, "sleep", waits.append)
    rows = load_http.run_cell(server.url, "closed-1", 800.0, 32, 3, ["q"], random.Random(0), {},
                              retry_immediately=retry_immediately)
    assert [r["status"] for r in rows] == [503, 503, 503]
    assert all(r["code"] == "budget_unreachable" and r["retry_after_s"] == 3.0 for r in rows)
    assert [r["i"] for r in rows] == [0, 1, 2]
    # One wait of Retry-After after each refusal, or none at all with retry_immediately.
    assert waits == ([] if retry_immediately else [3.0, 3.0, 3.0])


def test_open_loop_arrivals_never_retry(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(load_http.time, "sleep", waits.append)
    rows = load_http.run_cell(server.url, "poisson-100", 800.0, 32, 2, ["q"], random.Random(0), {})
    assert sorted(r["i"] for r in rows) == [0, 1] and all(r["status"] == 503 for r in rows)
    assert all(w < 1.0 for w in waits)  # only the arrival gaps (Poisson, 100/s), no Retry-After
