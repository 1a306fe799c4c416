"""A follow-up turn keeps the earlier turn's exact token sequence as its prefix.

The pipeline runs for real over fake model services (tests/api/fakes.py, one token per
character); the generator records every prompt it ran and its engine is a stand-in for the
local engine's block cache that holds every prompt run so far (:class:`FakeBlockCache` of
tests/app/test_warm_planning.py), so the planner's cached-token look-ups see what an engine that
stored each answer's blocks would hold.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from app.answering.kv_lookup import cached_per_k
from app.answering.pipeline import AnswerPipeline
from app.answering.state import AnswerRequest
from app.prompting.conversation import Turn
from latency_model.profile import Profile
from receipts.chain import get_receipt
from tests.api.fakes import CharTokenizer
from tests.app.test_warm_planning import CHUNK, QUESTION, CachingGenerator, services_with
from tests.app.test_warm_planning import profile as profile  # noqa: F401  (the module's fixture)

FOLLOW_UP = "And how often is its relief valve inspected?"


class RecordingGenerator(CachingGenerator):
    """Records each prompt it runs; its fake block cache then holds that prompt (as the local
    engine stores each block an answer computes)."""

    def __init__(self, tokenizer: CharTokenizer) -> None:
        super().__init__(tokenizer)
        self.prompts: list[list[int]] = []

    def stream(self, prompt_ids: list[int], **kw: Any) -> Any:
        self.prompts.append(list(prompt_ids))
        self.engine.warm.append(list(prompt_ids))
        return super().stream(prompt_ids, **kw)


@pytest.fixture
def world(tmp_path: Path, profile: Profile) -> Any:  # noqa: F811
    gen = RecordingGenerator(CharTokenizer())
    services = services_with(tmp_path, profile, gen)
    yield AnswerPipeline(services), gen
    services.close()


def _turn(pipe: Any, gen: Any, question: str, history: list[Turn]) -> tuple[Any, list[int]]:
    answer = pipe.answer(AnswerRequest(question=question, ttft_budget_ms=60_000, history=history))
    assert answer.status == "ok" and answer.receipt_id is not None
    return answer, gen.prompts[-1]


def test_a_follow_up_prompt_starts_with_the_earlier_prompt_and_answer_ids(world: Any) -> None:
    pipe, gen = world
    first, first_prompt = _turn(pipe, gen, QUESTION, [])
    first_ids = get_receipt(pipe.services.engine, first.receipt_id)["output"]["token_ids"]
    history = [Turn("user", QUESTION), Turn("assistant", first.text)]
    second, second_prompt = _turn(pipe, gen, FOLLOW_UP, history)
    assert second_prompt[:len(first_prompt) + len(first_ids)] == first_prompt + first_ids
    conv = get_receipt(pipe.services.engine, second.receipt_id)["prompt"]["conversation"]
    assert conv == {"layout": "earlier_turn", "receipt_id": first.receipt_id,
                    "prefix_tokens": len(first_prompt) + len(first_ids),
                    "earlier_prompt_tokens": len(first_prompt)}
    # the template's end of turn and the new user header follow the answer, then the new question
    builder = pipe.scaffold_and_builder()[1]
    close = builder._control_ids[builder.turns.assistant_to_user]
    rest = second_prompt[len(first_prompt) + len(first_ids):]
    assert rest[:len(close)] == close
    assert CharTokenizer().decode(rest).find("Question: " + FOLLOW_UP) > 0


def test_the_planner_prices_the_earlier_turn_as_cached(world: Any) -> None:
    pipe, gen = world
    first, first_prompt = _turn(pipe, gen, QUESTION, [])
    history = [Turn("user", QUESTION), Turn("assistant", first.text)]
    p = pipe.prepare(AnswerRequest(question=FOLLOW_UP, ttft_budget_ms=60_000, history=history))
    cached = cached_per_k(gen, p.full_prompt)
    scaffold = p.full_prompt.scaffold_len
    grid = scaffold + (len(first_prompt) - scaffold) // CHUNK * CHUNK  # whole blocks of the earlier prompt
    assert cached is not None and grid > scaffold
    assert all(c >= grid for c in cached), (cached, grid)
    assert [r.cached_tokens for r in p.plan.rows] == list(cached)


def test_an_edited_history_falls_back_to_text_turns(world: Any) -> None:
    pipe, gen = world
    first, first_prompt = _turn(pipe, gen, QUESTION, [])
    edited = [Turn("user", QUESTION), Turn("assistant", first.text + " Also blue.")]
    second, second_prompt = _turn(pipe, gen, FOLLOW_UP, edited)
    assert second_prompt[:len(first_prompt)] != first_prompt
    body = get_receipt(pipe.services.engine, second.receipt_id)
    assert body["prompt"]["conversation"] == {"layout": "text", "fallback": "no_matching_receipt"}
    assert "Also blue." in CharTokenizer().decode(second_prompt)  # the history as text turns


def test_a_follow_up_that_would_not_fit_the_window_drops_the_earlier_tokens_first(world: Any) -> None:
    pipe, gen = world
    first, first_prompt = _turn(pipe, gen, QUESTION, [])
    history = [Turn("user", QUESTION), Turn("assistant", first.text)]
    text = pipe.prepare(AnswerRequest(question=FOLLOW_UP, ttft_budget_ms=60_000, history=history[:1]))
    # a window the text layout fits with room for the output, the earlier turn's tokens do not
    gen.context_window = text.full_prompt.prompt_tokens_for(0) + text.max_new_tokens + 40
    assert gen.context_window < len(first_prompt) + text.max_new_tokens
    second, _ = _turn(pipe, gen, FOLLOW_UP, history)
    conv = get_receipt(pipe.services.engine, second.receipt_id)["prompt"]["conversation"]
    assert conv == {"layout": "text", "fallback": "window"}


def test_replay_of_a_follow_up_and_of_its_follow_up_rebuilds_the_same_tokens(world: Any) -> None:
    from app.answering.receipt_wiring import replay_receipt

    pipe, gen = world
    first, _ = _turn(pipe, gen, QUESTION, [])
    history = [Turn("user", QUESTION), Turn("assistant", first.text)]
    second, second_prompt = _turn(pipe, gen, FOLLOW_UP, history)
    history2 = [*history, Turn("user", FOLLOW_UP), Turn("assistant", second.text)]
    third, third_prompt = _turn(pipe, gen, "Who inspects it?", history2)
    assert third_prompt[:len(second_prompt)] == second_prompt
    conv = get_receipt(pipe.services.engine, third.receipt_id)["prompt"]["conversation"]
    assert conv["layout"] == "earlier_turn" and conv["receipt_id"] == second.receipt_id
    for answer in (second, third):
        report = replay_receipt(pipe.services, answer.receipt_id)
        assert report.check("prompt").status == "ok", report.render()


def test_replay_fails_when_the_earlier_turns_receipt_does_not_verify(world: Any) -> None:
    from sqlalchemy import update

    from app.answering.receipt_wiring import replay_receipt
    from foundation.db import WriterLock, write_transaction
    from receipts.models import ReceiptRow

    pipe, gen = world
    first, _ = _turn(pipe, gen, QUESTION, [])
    second, _ = _turn(pipe, gen, FOLLOW_UP, [Turn("user", QUESTION), Turn("assistant", first.text)])
    row_body = get_receipt(pipe.services.engine, first.receipt_id)
    row_body["output"]["token_ids"] = row_body["output"]["token_ids"][:-1]  # tampered
    from receipts.canonical import canonical_body

    with write_transaction(pipe.services.engine, WriterLock.RECEIPTS) as s:
        s.execute(update(ReceiptRow).where(ReceiptRow.id == first.receipt_id)
                  .values(body=canonical_body(row_body).decode()))  # its recorded hash kept
    report = replay_receipt(pipe.services, second.receipt_id)
    assert report.check("prompt").status == "failed", report.render()
    assert "does not match its hash" in report.check("prompt").detail
    # and a new follow-up on that history no longer continues it
    third, _ = _turn(pipe, gen, FOLLOW_UP, [Turn("user", QUESTION), Turn("assistant", first.text)])
    conv = get_receipt(pipe.services.engine, third.receipt_id)["prompt"]["conversation"]
    assert conv == {"layout": "text", "fallback": "earlier_turn_unverified"}


def test_advice_uses_the_same_layout(world: Any) -> None:
    pipe, gen = world
    first, first_prompt = _turn(pipe, gen, QUESTION, [])
    req = AnswerRequest(question=FOLLOW_UP, ttft_budget_ms=60_000,
                        history=[Turn("user", QUESTION), Turn("assistant", first.text)])
    advice = pipe.advise(req)
    assert advice.prompt_tokens > len(first_prompt)
    p = pipe.prepare(replace(req))
    assert p.prompt.ids[:len(first_prompt)] == first_prompt


def test_the_text_layout_switch_lays_a_matching_history_out_as_text(world: Any) -> None:
    pipe, gen = world
    first, first_prompt = _turn(pipe, gen, QUESTION, [])
    pipe.follow_up_layout = "text"
    history = [Turn("user", QUESTION), Turn("assistant", first.text)]
    second, second_prompt = _turn(pipe, gen, FOLLOW_UP, history)
    assert second_prompt[:len(first_prompt)] != first_prompt
    conv = get_receipt(pipe.services.engine, second.receipt_id)["prompt"]["conversation"]
    assert conv == {"layout": "text", "fallback": "text_layout_set"}
