"""Answers that ran in one batch of the local engine leave receipts that replay to identical tokens.

Six questions about the ingested pages arrive over HTTP at random (seeded) offsets
within 0.3 s, so the engine runs several of them in the same steps. Each answer's
receipt then goes through ``replay --regenerate`` (``app.answering.receipt_wiring.replay_receipt``):
the context is rebuilt from the stored chunks and the answer is generated again alone,
with the recorded prefill chunk; every check must pass, the regenerated output included.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import httpx
import pytest

from tests.answer.conftest import BUDGET_MS, wait_idle

pytestmark = pytest.mark.slow

QUESTIONS = [
    "How do I dump a database with pg_dump in the custom archive format?",
    "Why must tables be vacuumed regularly?",
    "How do I set up continuous archiving of WAL files?",
    "What does autovacuum do?",
    "How do I restore a dump made in the directory format?",
    "What is transaction ID wraparound?",
]


def test_receipts_of_batched_answers_replay_with_identical_tokens(live_server: Any,
                                                                  answer_services: Any) -> None:
    from app.answering.receipt_wiring import replay_receipt

    engine = answer_services.generator.engine
    assert engine.max_running >= 2, "the local engine must batch for this test to mean anything"
    wait_idle(live_server.pipeline)
    engine.peak_rows_answers = 0
    rnd = random.Random(19)
    offsets = [rnd.uniform(0.0, 0.3) for _ in QUESTIONS]
    answers: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            time.sleep(offsets[i])
            r = httpx.post(f"{live_server.base_url}/v1/answer", timeout=300, json={
                "question": QUESTIONS[i], "ttft_budget_ms": BUDGET_MS, "max_new_tokens": 12})
            assert r.status_code == 200, r.text
            answers[i] = r.json()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    wait_idle(live_server.pipeline)
    assert engine.peak_rows_answers >= 2, "no step carried two answers: nothing was batched"
    for i, a in sorted(answers.items()):
        assert a["receipt_id"], a
        report = replay_receipt(answer_services, a["receipt_id"], regenerate=True)
        assert report.check("regenerate").status == "ok", (QUESTIONS[i], report.render())
        assert report.ok, report.render()
