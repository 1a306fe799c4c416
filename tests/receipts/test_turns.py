"""Answered turns by content (receipts.turns): a follow-up's history finds the receipt that
answered it by an index lookup, on SQLite and PostgreSQL; an edited history finds nothing."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from foundation.db import read_session
from ragbudget_testing.synthetic_receipts import body
from receipts.chain import append_receipt
from receipts.models import ReceiptTurn
from receipts.turns import body_turn_hash, find_turn, turn_hash


def _history(b: dict[str, Any]) -> list[dict[str, str]]:
    return [*b["request"]["messages"], {"role": "assistant", "content": b["output"]["text"]}]


def test_a_history_that_is_a_receipts_messages_and_answer_finds_that_receipt(engine: Any) -> None:
    first, other = body(question="How do I archive WAL?"), body(question="What is autovacuum?")
    rid = append_receipt(engine, first).id
    append_receipt(engine, other)
    assert find_turn(engine, _history(first)) == rid
    with read_session(engine) as s:
        assert s.scalar(select(ReceiptTurn.turn_hash).where(ReceiptTurn.receipt_seq == 1)) == \
            turn_hash(_history(first))


def test_an_edited_history_finds_no_receipt(engine: Any) -> None:
    b = body()
    append_receipt(engine, b)
    edited = _history(b)
    edited[-1] = {"role": "assistant", "content": b["output"]["text"] + " (edited)"}
    assert find_turn(engine, edited) is None
    assert find_turn(engine, _history(b)[:-1]) is None  # the question alone is not an answered turn


def test_the_latest_of_two_receipts_that_answered_the_same_turn_is_found(engine: Any) -> None:
    append_receipt(engine, body())
    second = append_receipt(engine, body()).id
    assert find_turn(engine, _history(body())) == second


def test_a_receipt_without_output_has_no_turn() -> None:
    b = body(status="failed")
    b["output"] = None
    assert body_turn_hash(b) is None
    assert body_turn_hash(body()) is not None


def test_the_turn_hash_ignores_a_participant_name_but_not_a_role() -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert turn_hash([{**msgs[0], "name": "ana"}, msgs[1]]) == turn_hash(msgs)
    assert turn_hash([{"role": "system", "content": "q"}, msgs[1]]) != turn_hash(msgs)
