"""Answered turns by content: which receipt answered exactly this conversation.

A follow-up on ``/v1/chat/completions`` sends its conversation so far: the earlier messages,
then the assistant's answer. When that history is exactly an earlier receipt's request
messages followed by that receipt's answer text, the follow-up's prompt can continue the
earlier prompt token for token (``app.answering.followup``). To find that receipt by an index
lookup, every receipt with an output gets a ``receipt_turns`` row (written in the transaction
that appends it, :func:`receipts.chain.append_in_transaction`) holding :func:`turn_hash` of
``request.messages + [{"role": "assistant", "content": output.text}]``.

The hash covers each message's role and content only (not a participant ``name``: the
prompt is the same with or without one), as canonical JSON (:func:`foundation.hashing.sha256_json`).
Several receipts may answer one conversation with the same text (the same question asked
twice); :func:`find_turn` returns the latest of them (highest ``seq``), a deterministic choice
for a given chain, recorded in the follow-up's receipt so replay never looks it up again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, select

from foundation.db import read_session
from foundation.hashing import sha256_json
from receipts.models import ReceiptRow, ReceiptTurn


def turn_hash(messages: Sequence[dict[str, Any]]) -> str:
    """``sha256:`` over the canonical JSON of ``[{"role", "content"}, ...]`` of ``messages``
    (any other key ignored), in order."""
    return sha256_json([{"role": str(m["role"]), "content": str(m["content"])} for m in messages])


def body_turn_hash(content: dict[str, Any]) -> str | None:
    """:func:`turn_hash` of a receipt body's request messages followed by its answer, or None
    when the body has no request messages or no output text (nothing a follow-up continues)."""
    messages = (content.get("request") or {}).get("messages")
    output = content.get("output") or {}
    if not messages or not isinstance(output.get("text"), str):
        return None
    return turn_hash([*messages, {"role": "assistant", "content": output["text"]}])


def find_turn(engine: Engine, history: Sequence[dict[str, Any]]) -> str | None:
    """The id of the latest receipt whose request messages followed by its answer are exactly
    ``history`` (roles and contents), or None."""
    digest = turn_hash(history)
    with read_session(engine) as session:
        return session.scalar(
            select(ReceiptRow.id).join(ReceiptTurn, ReceiptTurn.receipt_seq == ReceiptRow.seq)
            .where(ReceiptTurn.turn_hash == digest).order_by(ReceiptRow.seq.desc()).limit(1))
