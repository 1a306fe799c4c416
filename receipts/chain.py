"""The chained receipt log: append (atomic, fork-free), get, list with filters and paging.

Each receipt body is stored as its canonical JSON (RFC 8785 from format
version 2, Python's canonical JSON for version 1; :mod:`receipts.canonical`)
and carries its own ``hash``: ``sha256:`` over the canonical JSON of the body
*without* the ``hash`` field (:func:`receipt_hash`). The body's
``prev_hash`` is the previous receipt's hash (:data:`GENESIS` for the first),
so the receipts form one chain; ``receipts.prev_hash`` is UNIQUE, so two
writers can never both extend the same head. Verification of the whole chain
lives in :mod:`receipts.verify`, which reads this module; this module never reads it.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, delete, exists, insert, select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from foundation.bounds import check_int64, check_text, parse_decimal_int64, parse_utc_time
from foundation.db import WriterLock, read_session, write_transaction
from foundation.errors import Conflict, IntegrityFailure, InvalidInput, UnknownReceipt
from foundation.provenance import to_utc_iso, utc_now_iso
from receipts.canonical import canonical_body, receipt_hash
from receipts.models import ReceiptDocument, ReceiptJournalRow, ReceiptRow, ReceiptTurn
from receipts.schema import CHAIN_FIELDS, FORMAT_VERSION, STATUSES, document_versions, validate_body
from receipts.turns import body_turn_hash
from retrieval.document_ids import lookup_document_id

GENESIS = "sha256:" + "0" * 64
MAX_LIST_LIMIT = 1000
MAX_RECEIPT_ID_BYTES = 256  # the id column holds 64 characters (4 bytes each at most)


@dataclass(frozen=True)
class StoredReceipt:
    """Where a receipt landed in the chain."""

    seq: int
    id: str
    hash: str
    prev_hash: str
    created_at: str

    def to_dict(self) -> dict[str, Any]:
        """``{"seq", "id", "hash", "prev_hash", "created_at"}`` (hashes as ``sha256:<hex>``)."""
        return {"seq": self.seq, "id": self.id, "hash": self.hash, "prev_hash": self.prev_hash,
                "created_at": self.created_at}


__all__ = ["GENESIS", "StoredReceipt", "append_in_transaction", "append_receipt", "get_receipt",
           "get_receipt_row", "head", "list_receipts", "new_receipt_id", "parse_body", "receipt_hash",
           "summarize"]


def parse_body(text: str) -> dict[str, Any]:
    """Parse a stored body.

    Raises:
        IntegrityFailure: the stored text is not a JSON object.
    """
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise IntegrityFailure(f"stored receipt body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise IntegrityFailure("stored receipt body is not a JSON object")
    return body


def append_receipt(engine: Engine, body: dict[str, Any], *, receipt_id: str | None = None,
                   max_attempts: int = 50) -> StoredReceipt:
    """Append ``body`` to the chain in one transaction; return where it landed.

    Inside one serialised write transaction (``BEGIN IMMEDIATE`` on SQLite, an
    advisory lock on PostgreSQL) the head is read, the chain fields are set
    (``id`` = ``receipt_id`` or a new ``rcpt_<uuid4 hex>``, ``seq`` = head + 1,
    ``created_at`` ISO-8601 UTC µs and never earlier than the head's, ``prev_hash``,
    ``format_version``), the hash is computed, and the receipt row plus one
    ``receipt_documents`` row per distinct candidate (document id, version) and, for a
    receipt with an output, its ``receipt_turns`` row (:mod:`receipts.turns`) are
    inserted; the journal row of ``receipt_id`` (:mod:`receipts.journal`), if any,
    is deleted in the same transaction. Wholly there or not at all. Should two
    writers still race for the same head (the UNIQUE ``prev_hash`` rejects the
    second), the loser retries with the new head. On success the chain fields are
    also written into ``body``.

    Raises:
        InvalidInput: the body does not validate (:func:`receipts.schema.validate_body`).
        Conflict: a receipt ``receipt_id`` exists already (e.g. the answer was recorded as
            interrupted by another process), or no free head after ``max_attempts`` tries.
    """
    validate_body(body)
    content = {k: v for k, v in body.items() if k not in CHAIN_FIELDS}
    last_exc: Exception | None = None
    for attempt in range(max_attempts):
        # A fresh id per attempt unless one was reserved: a clash on the id is a race too.
        rid = receipt_id if receipt_id is not None else new_receipt_id()
        try:
            with write_transaction(engine, WriterLock.RECEIPTS) as session:
                full = append_in_transaction(session, content, rid, check_id=receipt_id is not None)
        except (IntegrityError, OperationalError) as exc:
            if isinstance(exc, OperationalError) and "locked" not in str(exc).lower():
                raise
            last_exc = exc
            time.sleep(min(0.2, 0.002 * (attempt + 1)) * random.random())
            continue
        for key in CHAIN_FIELDS:
            body[key] = full[key]
        return StoredReceipt(seq=full["seq"], id=full["id"], hash=full["hash"],
                             prev_hash=full["prev_hash"], created_at=full["created_at"])
    raise Conflict(f"could not append a receipt after {max_attempts} attempts: {last_exc}")


def new_receipt_id() -> str:
    """A fresh receipt id: ``rcpt_`` + 32 hex digits of a uuid4."""
    return "rcpt_" + uuid.uuid4().hex


def append_in_transaction(session: Session, content: dict[str, Any], receipt_id: str, *,
                          check_id: bool = True, created_at: str | None = None) -> dict[str, Any]:
    """Append ``content`` (a validated body without chain fields) as ``receipt_id`` inside
    ``session``, a write transaction holding ``WriterLock.RECEIPTS``; delete the journal row of
    ``receipt_id``. Returns the full stored body (chain fields and hash included).

    ``created_at``: the receipt's time (ISO-8601 UTC) when it was made before this append (a
    spooled receipt, :mod:`receipts.spool`; it may be earlier than the head's); None: now,
    never earlier than the head's.

    Raises:
        Conflict: ``check_id`` and a receipt ``receipt_id`` exists already.
    """
    if check_id and session.scalar(select(ReceiptRow.seq).where(ReceiptRow.id == receipt_id)) is not None:
        raise Conflict(f"receipt {receipt_id} exists already", receipt_id=receipt_id)
    head = session.execute(
        select(ReceiptRow.seq, ReceiptRow.hash, ReceiptRow.created_at)
        .order_by(ReceiptRow.seq.desc()).limit(1)
    ).first()
    seq, prev_hash, head_at = (head[0] + 1, head[1], head[2]) if head else (1, GENESIS, "")
    at = created_at if created_at is not None else max(utc_now_iso(), head_at)
    full = dict(content, id=receipt_id, seq=seq, created_at=at,
                prev_hash=prev_hash, format_version=FORMAT_VERSION)
    digest = receipt_hash(full)
    full["hash"] = digest
    session.execute(insert(ReceiptRow).values(
        seq=seq, id=receipt_id, created_at=full["created_at"], status=full["status"],
        prev_hash=prev_hash, hash=digest, body=canonical_body(full).decode("utf-8")))
    docs = document_versions(content)
    if docs:
        session.execute(insert(ReceiptDocument), [
            {"receipt_seq": seq, "document_id": d, "version": v} for d, v in docs])
    turn = body_turn_hash(content)
    if turn is not None:  # the answered turn, for follow-ups that continue it (receipts.turns)
        session.execute(insert(ReceiptTurn).values(receipt_seq=seq, turn_hash=turn))
    session.execute(delete(ReceiptJournalRow).where(ReceiptJournalRow.id == receipt_id))
    return full


def get_receipt_row(engine: Engine, receipt_id: str) -> ReceiptRow:
    """The stored row of ``receipt_id``.

    Raises:
        InvalidInput: an id no backend can hold (NUL, not Unicode, over 256 bytes).
        UnknownReceipt: no receipt has that id.
    """
    check_text(receipt_id, "receipt_id", max_bytes=MAX_RECEIPT_ID_BYTES)
    with read_session(engine) as session:
        row = session.scalars(select(ReceiptRow).where(ReceiptRow.id == receipt_id)).first()
        if row is None:
            raise UnknownReceipt(f"no receipt {receipt_id!r}", receipt_id=receipt_id)
        session.expunge(row)
        return row


def get_receipt(engine: Engine, receipt_id: str) -> dict[str, Any]:
    """The full body of ``receipt_id`` (including its chain fields and hash).

    Raises:
        UnknownReceipt: no receipt has that id.
        IntegrityFailure: the stored body is not a JSON object.
    """
    return parse_body(get_receipt_row(engine, receipt_id).body)


def _utc_iso(value: str | datetime | None, name: str) -> str | None:
    if value is None:
        return None
    return to_utc_iso(parse_utc_time(value, name))


def summarize(seq: int, body: dict[str, Any], row_hash: str) -> dict[str, Any]:
    """A short listing entry for one receipt (no candidates, no output text)."""
    plan = body.get("plan") or {}
    timings = body.get("timings") or {}
    generator = body.get("generator") or {}
    return {
        "seq": seq, "id": body.get("id"), "created_at": body.get("created_at"),
        "status": body.get("status"), "hash": row_hash, "question": body.get("question"),
        "revision": (body.get("corpus") or {}).get("revision"), "chosen_k": plan.get("chosen_k"),
        "budget_ms": plan.get("budget_ms"), "ttft_ms": timings.get("ttft_ms"),
        "within_budget": within_budget(body), "model_id": generator.get("model_id"),
    }


def within_budget(body: dict[str, Any]) -> bool | None:
    """Measured TTFT <= the plan's budget; ``None`` when either is missing (no first token)."""
    ttft = (body.get("timings") or {}).get("ttft_ms")
    budget = (body.get("plan") or {}).get("budget_ms")
    if ttft is None or budget is None:
        return None
    return bool(ttft <= budget)


def list_receipts(
    engine: Engine,
    *,
    since: str | datetime | None = None,
    until: str | datetime | None = None,
    document_id: str | None = None,
    document_version: int | None = None,
    status: str | None = None,
    within: bool | None = None,
    limit: int = 50,
    cursor: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """Receipts newest first, filtered, one page at a time.

    ``since`` is inclusive and ``until`` exclusive (ISO-8601; naive means UTC);
    ``document_id`` (optionally with ``document_version``) keeps receipts whose
    candidates came from that document; ``status`` is ok/cancelled/failed/interrupted;
    ``within`` keeps receipts whose measured TTFT was (True) or was not (False) within
    their budget (:func:`within_budget`; receipts without a TTFT match neither).
    ``cursor`` is the ``next_cursor`` of the previous page (``None`` on the last).

    Returns:
        ``(summaries, next_cursor)``; see :func:`summarize` for a summary's keys.

    Raises:
        InvalidInput: a bad time, status, limit (1..1000) or cursor.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidInput(f"limit must be between 1 and {MAX_LIST_LIMIT}", field="limit")
    if status is not None and status not in STATUSES:
        raise InvalidInput(f"status must be one of {', '.join(STATUSES)}", field="status")
    if document_id is not None:
        document_id = lookup_document_id(document_id)
    if document_version is not None:
        document_version = check_int64(document_version, "document_version", lo=1)
    query = select(ReceiptRow.seq, ReceiptRow.hash, ReceiptRow.body).order_by(ReceiptRow.seq.desc())
    if cursor is not None:
        query = query.where(ReceiptRow.seq < parse_decimal_int64(cursor, "cursor", lo=1))
    lo, hi = _utc_iso(since, "since"), _utc_iso(until, "until")
    if lo is not None:
        query = query.where(ReceiptRow.created_at >= lo)
    if hi is not None:
        query = query.where(ReceiptRow.created_at < hi)
    if status is not None:
        query = query.where(ReceiptRow.status == status)
    if document_id is not None:
        used = (ReceiptDocument.receipt_seq == ReceiptRow.seq) & (ReceiptDocument.document_id == document_id)
        if document_version is not None:
            used = used & (ReceiptDocument.version == document_version)
        query = query.where(exists().where(used))
    if within is None:
        with read_session(engine) as session:
            rows = session.execute(query.limit(limit + 1)).all()
        page = [summarize(seq, parse_body(text), digest) for seq, digest, text in rows[:limit]]
        next_cursor = str(rows[limit - 1][0]) if len(rows) > limit else None
        return page, next_cursor
    # Budget adherence lives in the body: scan newest first in batches until a page is full.
    matches: list[dict[str, Any]] = []
    batch, last_seq = max(4 * (limit + 1), 200), None
    with read_session(engine) as session:
        while len(matches) <= limit:
            q = query if last_seq is None else query.where(ReceiptRow.seq < last_seq)
            rows = session.execute(q.limit(batch)).all()
            for seq, digest, text in rows:
                summary = summarize(seq, parse_body(text), digest)
                if summary["within_budget"] is within:
                    matches.append(summary)
            if len(rows) < batch:
                break
            last_seq = rows[-1][0]
    next_cursor = str(matches[limit - 1]["seq"]) if len(matches) > limit else None
    return matches[:limit], next_cursor


def head(engine: Engine) -> StoredReceipt | None:
    """The newest receipt's position in the chain, or ``None`` for an empty chain."""
    with read_session(engine) as session:
        row = session.execute(
            select(ReceiptRow.seq, ReceiptRow.id, ReceiptRow.hash, ReceiptRow.prev_hash,
                   ReceiptRow.created_at).order_by(ReceiptRow.seq.desc()).limit(1)).first()
    return StoredReceipt(*row) if row else None
