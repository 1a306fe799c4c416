"""A remote engine that accepts an answer and sends no first token in time (app.fleet): its
deadline from the plan, the engine out of rotation, the answer retried once elsewhere while
budget is left, else failed with ``first_token_timeout`` and its one receipt.

Unit level: the fleet of tests/app/test_fleet_routing.py (fake generators, real planner and
store); engine ``fast``'s generator stands for a stalled server, waiting for the deadline the
pipeline set on its stream and then failing as the remote backend does
(:func:`generation.remote_deadline.first_token_timeout`). The backend's own side of it is
tests/generation/test_remote_deadline.py, the real server's tests/engine/test_fleet_llama.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from app.answering.pipeline import AnswerPipeline
from app.answering.state import AnswerRequest
from app.fleet import FIRST_TOKEN_P95_FACTOR, engine_gone, first_token_allowed_ms
from foundation.errors import BackendError
from generation.base import StreamBody, TokenStream
from generation.remote_deadline import first_token_timeout
from latency_model.profile import Profile
from tests.api.fakes import CharTokenizer, EchoGenerator
from tests.app.test_fleet_routing import QUESTION, fleet_services, profiles  # noqa: F401 - fixture
from tests.latency_model.conftest import IDENTITY


class StalledGenerator(EchoGenerator):
    """Accepts every answer, then sends nothing until the stream's first-token deadline, where
    it fails as :mod:`generation.remote` does; records each deadline it was given (s from send)."""

    def __init__(self, tokenizer: CharTokenizer) -> None:
        super().__init__(tokenizer)
        self.allowed_s: list[float | None] = []

    def stream(self, prompt_ids: list[int], **kwargs: Any) -> TokenStream:
        inner = super().stream(prompt_ids, **kwargs)

        def body(outer: TokenStream) -> StreamBody:
            yield None
            sent = time.perf_counter()
            deadline = outer.first_token_deadline_t
            self.allowed_s.append(None if deadline is None else deadline - sent)
            try:
                if deadline is None:
                    raise AssertionError("no first-token deadline was set on a remote engine's stream")
                time.sleep(max(deadline - sent, 0.0))
                raise first_token_timeout("http://stalled/v1", (time.perf_counter() - sent) * 1000.0,
                                          (deadline - sent) * 1000.0)
            finally:
                inner.close()
                outer.stats = inner.stats

        return TokenStream(body)


def _stalled_fleet(tmp_path: Path, fitted: dict[str, Profile], **overrides: Any) -> tuple[Any, Any]:
    services = fleet_services(tmp_path, fitted, **overrides)
    stalled = StalledGenerator(services.tokenizer)  # type: ignore[arg-type]
    stalled.identity = dict(IDENTITY)
    services.__dict__["generator"] = stalled  # engine "fast" stalls
    return services, stalled


def test_the_allowance_is_twice_the_p95_plus_the_margin_bounded_by_a_budget_that_must_be_made() -> None:
    assert FIRST_TOKEN_P95_FACTOR == 2.0
    assert first_token_allowed_ms(300.0, 1000.0) == 1600.0
    assert first_token_allowed_ms(300.0, 1000.0, budget_left_ms=900.0) == 900.0
    assert first_token_allowed_ms(300.0, 1000.0, budget_left_ms=5000.0) == 1600.0
    assert first_token_allowed_ms(300.0, 0.0, budget_left_ms=-20.0) == 0.0
    with pytest.raises(ValueError):
        first_token_allowed_ms(float("nan"), 0.0)
    with pytest.raises(ValueError):
        first_token_allowed_ms(10.0, -1.0)


def test_a_first_token_timeout_counts_as_the_engine_gone_unless_nothing_was_sent() -> None:
    assert engine_gone(first_token_timeout("http://x/v1", 1200.0, 1000.0))
    assert not engine_gone(first_token_timeout("http://x/v1", 0.0, 0.0, sent=False))
    assert not engine_gone(BackendError("remote server error: bad prompt"))


def test_a_stalled_engine_is_taken_out_and_the_answer_is_retried_once_elsewhere(
        profiles: dict[str, Profile], tmp_path: Path) -> None:  # noqa: F811 - fixture
    from receipts.chain import get_receipt_row, parse_body
    from receipts.verify import verify_chain

    services, stalled = _stalled_fleet(tmp_path, profiles, engine_first_token_margin_ms=50.0)
    pipe = AnswerPipeline(services)
    t0 = time.perf_counter()
    got = pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
    took_s = time.perf_counter() - t0
    assert got.status == "ok" and got.text == "fake answer" and got.predicted.engine_id == "slow"
    # the deadline came from the plan (its p95 twice, plus the margin), not the 60 s budget
    assert len(stalled.allowed_s) == 1 and stalled.allowed_s[0] is not None
    assert 0.05 <= stalled.allowed_s[0] < 5.0 and took_s < 10.0
    fast = pipe.engines["fast"]
    assert not fast.healthy and "first token" in (fast.health.reason or "")
    body = parse_body(get_receipt_row(services.engine, got.receipt_id).body)
    assert body["plan"]["fleet"]["retried_from"] == "fast" and body["status"] == "ok"
    assert "first token" in body["plan"]["fleet"]["retry_reason"]
    assert verify_chain(services.engine).ok and verify_chain(services.engine).checked == 1
    services.close()


def test_with_no_budget_left_a_stalled_answer_that_must_make_it_fails_with_its_own_receipt(
        profiles: dict[str, Profile], tmp_path: Path) -> None:  # noqa: F811 - fixture
    from receipts.chain import get_receipt_row, parse_body
    from receipts.verify import verify_chain

    # a margin far past the budget: the budget bounds the wait
    services, stalled = _stalled_fleet(tmp_path, profiles, engine_first_token_margin_ms=60_000.0)
    pipe = AnswerPipeline(services)
    probe = pipe.prepare(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
    row0 = pipe.engines["fast"].profile().predict_ttft_many(
        [probe.full_prompt.prompt_tokens_for(0)], [0], [probe.full_prompt.scaffold_len])
    budget = max(4.0 * float(row0[1][0]), 300.0)  # fast makes k = 0 in it; nothing is left after
    got = pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=budget, on_budget_miss="reject"))
    assert got.status == "failed" and got.error is not None and got.error.code == "first_token_timeout"
    assert got.predicted.engine_id == "fast" and got.receipt_status == "written"
    assert stalled.allowed_s[0] is not None and stalled.allowed_s[0] * 1000.0 <= budget
    body = parse_body(get_receipt_row(services.engine, got.receipt_id).body)
    assert body["status"] == "failed" and body["generator"]["engine_id"] == "fast"
    assert "retried_from" not in body["plan"]["fleet"]
    assert not pipe.engines["fast"].healthy
    report = verify_chain(services.engine)
    assert report.ok and report.checked == 1  # one receipt, not two
    services.close()


def test_the_local_engine_gets_no_first_token_deadline(tmp_path: Path) -> None:
    from app.answering.state import AnswerSwitches
    from app.fleet import FleetEngine
    from app.settings import EngineConfig, get_settings

    class _Pipe:
        settings = get_settings(data_dir=tmp_path)
        switches = AnswerSwitches.of(settings)
        metrics = None
        services = None

    engine = FleetEngine(_Pipe(), EngineConfig(id="local", kind="local"), 0)
    stream = TokenStream(lambda s: iter([None]))  # type: ignore[arg-type, return-value]
    assert engine.arm_first_token(stream, None) is None  # type: ignore[arg-type]
    assert stream.first_token_deadline_t is None
    engine.close()
