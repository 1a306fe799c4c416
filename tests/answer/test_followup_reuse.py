"""A follow-up turn on the local engine loads the earlier turn from the block cache, and replays cold.

Three turns of one conversation on the real model: the second turn's prompt starts with the
first turn's exact prompt and output ids (rebuilt from their receipts and checked against
their hashes), and the engine loads at least every whole block of the first turn's prompt from
the prefix cache; the third turn loads past the whole first turn, its answer included (the
second turn's prefill stored those blocks). The third turn's receipt then goes through
``replay --regenerate`` with the prefix cache emptied: the rebuilt prompt (through both earlier
receipts) and the cold regeneration must match what was recorded.
"""

from __future__ import annotations

from typing import Any

import pytest

from app.answering.followup import earlier_turn
from app.answering.state import AnswerRequest
from app.prompting.conversation import Turn
from receipts.chain import get_receipt
from tests.answer.conftest import BUDGET_MS, QUESTION, wait_idle

pytestmark = pytest.mark.slow

FOLLOW_UPS = ("And how do I restore that dump?", "Which format should I choose for that?")


def test_follow_ups_load_the_earlier_turns_from_the_block_cache_and_replay_cold(live_server: Any,
                                                                                answer_services: Any) -> None:
    from app.answering.receipt_wiring import replay_receipt

    pipe = live_server.pipeline
    gen = answer_services.generator
    wait_idle(pipe)
    history: list[Turn] = []
    answers = []
    for question in (QUESTION, *FOLLOW_UPS):
        answer = pipe.answer(AnswerRequest(question=question, ttft_budget_ms=BUDGET_MS, max_new_tokens=8,
                                           history=list(history)))
        assert answer.status == "ok" and answer.receipt_id is not None
        answers.append(answer)
        history += [Turn("user", question), Turn("assistant", answer.text)]
    turns = [earlier_turn(answer_services, a.receipt_id) for a in answers]  # verified against their hashes
    chunk = gen.prefill_chunk
    scaffold_len = len(pipe.scaffold_and_builder()[1].scaffold_ids(pipe.scaffold_and_builder()[0].text))
    for before, after, answer in zip(turns, turns[1:], answers[1:], strict=False):
        exact = list(before.prompt_ids) + list(before.answer_ids)
        assert list(after.prompt_ids[:len(exact)]) == exact
        conv = get_receipt(answer_services.engine, answer.receipt_id)["prompt"]["conversation"]
        assert conv["layout"] == "earlier_turn" and conv["prefix_tokens"] == len(exact)
        # every whole block of the earlier prompt is served (blocks from the scaffold's end on)
        grid = scaffold_len + (len(before.prompt_ids) - scaffold_len) // chunk * chunk
        assert grid > scaffold_len, "the earlier prompt should hold at least one block past the scaffold"
        assert answer.tokens.cached >= grid, (answer.tokens.cached, grid)
    # the third turn loads past the whole first turn, its answer included
    assert answers[2].tokens.cached > turns[0].prefix_tokens, (answers[2].tokens.cached,
                                                               turns[0].prefix_tokens)
    try:
        gen.prefix_cache.clear()
        report = replay_receipt(answer_services, answers[2].receipt_id, regenerate=True)
        assert report.check("prompt").status == "ok", report.render()
        assert report.check("regenerate").status == "ok", report.render()
    finally:
        pipe.warm()  # the scaffold cached again for the other tests of the session
