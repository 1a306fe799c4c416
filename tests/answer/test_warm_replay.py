"""An answer that took retrieved chunks from the prefix cache replays cold to identical tokens.

The same question is answered twice on the local engine: the second answer's prompt (same
chunks, same layout) finds the first one's blocks beyond the scaffold in the prefix cache and
loads them (``tokens.cached`` past the scaffold), and its plan priced them as cached. Its
receipt then goes through ``replay --regenerate`` with the prefix cache emptied first, so the
regeneration computes every block cold: the output tokens must be identical.
"""

from __future__ import annotations

from typing import Any

import pytest

from app.answering.state import AnswerRequest
from tests.answer.conftest import BUDGET_MS, QUESTION, wait_idle

pytestmark = pytest.mark.slow


def test_replay_regenerate_of_a_warm_answer_recomputes_cold_and_matches(live_server: Any,
                                                                        answer_services: Any) -> None:
    from app.answering.receipt_wiring import replay_receipt

    pipe = live_server.pipeline
    gen = answer_services.generator
    wait_idle(pipe)
    req = AnswerRequest(question=QUESTION, ttft_budget_ms=BUDGET_MS, max_new_tokens=8)
    first = pipe.answer(req)
    warm = pipe.answer(req)
    assert first.status == warm.status == "ok" and warm.receipt_id is not None
    scaffold = len(pipe.scaffold_and_builder()[1].scaffold_ids(pipe.scaffold_and_builder()[0].text))
    assert warm.tokens.cached > scaffold, "the second answer should load blocks past the scaffold"
    assert warm.predicted.cached_tokens_per_k is not None
    assert warm.predicted.cached_tokens_per_k[warm.chosen_k] == warm.tokens.cached  # priced as loaded
    try:
        gen.prefix_cache.clear()
        assert len(gen.prefix_cache) == 0  # the regeneration can only compute cold
        report = replay_receipt(answer_services, warm.receipt_id, regenerate=True)
        assert report.check("regenerate").status == "ok", report.render()
        assert report.ok, report.render()
        assert warm.text == first.text
    finally:
        pipe.warm()  # the scaffold cached again for the other tests of the session
