"""Tamper tests: each kind of edit is detected and located (SQLite and PostgreSQL)."""

import json

from sqlalchemy import delete, select, update

from foundation.db import WriterLock, write_transaction
from ragbudget_testing.synthetic_receipts import body
from receipts.canonical import canonical_body
from receipts.chain import append_receipt, receipt_hash
from receipts.models import ReceiptDocument, ReceiptRow
from receipts.verify import verify_chain


def _chain(engine, n=5):
    return [append_receipt(engine, body(question=f"question {i}")) for i in range(n)]


def _rewrite(engine, seq, edit, *, rehash=False, set_column=True):
    """Apply ``edit(body)`` to receipt ``seq``'s stored body (optionally recomputing its hash)."""
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        row = s.scalars(select(ReceiptRow).where(ReceiptRow.seq == seq)).one()
        b = json.loads(row.body)
        edit(b)
        if rehash:
            b["hash"] = receipt_hash(b)
            if set_column:
                row.hash = b["hash"]
        row.body = canonical_body(b).decode("utf-8")


def _kinds(report):
    return [(p.kind, p.seq) for p in report.problems]


def test_intact_chain_verifies(engine):
    stored = _chain(engine)
    report = verify_chain(engine, batch_size=2)
    assert report.ok and report.checked == 5
    assert report.head == {"seq": 5, "id": stored[-1].id, "hash": stored[-1].hash}


def test_empty_chain_verifies(engine):
    report = verify_chain(engine)
    assert report.ok and report.head is None


def test_edited_field_is_located(engine):
    stored = _chain(engine)
    _rewrite(engine, 3, lambda b: b.__setitem__("question", "something else"))
    report = verify_chain(engine, batch_size=2)
    assert _kinds(report) == [("edited", 3)]
    assert report.problems[0].receipt_id == stored[2].id
    assert report.problems[0].expected == stored[2].hash


def test_changed_score_is_located(engine):
    _chain(engine)
    _rewrite(engine, 2, lambda b: b["candidates"][0].__setitem__("score", 0.99))
    assert _kinds(verify_chain(engine)) == [("edited", 2)]


def test_replaced_hash_column_is_located(engine):
    stored = _chain(engine)
    fake = "sha256:" + "f" * 64
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        s.execute(update(ReceiptRow).where(ReceiptRow.seq == 4).values(hash=fake))
    report = verify_chain(engine)
    assert _kinds(report) == [("hash_mismatch", 4)]
    assert (report.problems[0].expected, report.problems[0].actual) == (stored[3].hash, fake)


def test_rewritten_receipt_with_recomputed_hash_breaks_the_next_link(engine):
    _chain(engine)
    _rewrite(engine, 2, lambda b: b.__setitem__("question", "forged"), rehash=True)
    assert _kinds(verify_chain(engine)) == [("broken_link", 3)]


def test_deleted_receipt_is_located(engine):
    _chain(engine)
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        s.execute(delete(ReceiptDocument).where(ReceiptDocument.receipt_seq == 3))
        s.execute(delete(ReceiptRow).where(ReceiptRow.seq == 3))
    report = verify_chain(engine)
    assert _kinds(report) == [("missing", 3)]


def test_deleted_tail_is_caught_by_an_anchored_head(engine):
    stored = _chain(engine)
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        s.execute(delete(ReceiptDocument).where(ReceiptDocument.receipt_seq == 5))
        s.execute(delete(ReceiptRow).where(ReceiptRow.seq == 5))
    assert verify_chain(engine).ok  # a cut tail leaves no gap ...
    report = verify_chain(engine, expected_head=stored[-1].hash)
    assert _kinds(report) == [("missing", None)]  # ... but the anchor is gone


def test_reordered_pair_is_located(engine):
    _chain(engine)
    cols = ("id", "created_at", "status", "prev_hash", "hash", "body")
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        a, b = (s.scalars(select(ReceiptRow).where(ReceiptRow.seq == n)).one() for n in (2, 3))
        va, vb = ({c: getattr(r, c) for c in cols} for r in (a, b))
        # move the unique columns out of the way first, then swap
        for r, tmp in ((a, "x"), (b, "y")):
            r.id, r.prev_hash, r.hash = tmp, tmp, tmp
        s.flush()
        for r, v in ((a, vb), (b, va)):
            for c in cols:
                setattr(r, c, v[c])
    report = verify_chain(engine)
    assert _kinds(report) == [("reordered", 2), ("reordered", 3)]


def test_edited_status_column_is_located(engine):
    _chain(engine)
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        s.execute(update(ReceiptRow).where(ReceiptRow.seq == 1).values(status="failed"))
    report = verify_chain(engine)
    assert _kinds(report) == [("edited", 1)]
    assert "status" in report.problems[0].detail


def test_tampered_document_index_is_located(engine):
    _chain(engine)
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        s.execute(delete(ReceiptDocument).where(ReceiptDocument.receipt_seq == 2,
                                                ReceiptDocument.document_id == "doc-b"))
    assert _kinds(verify_chain(engine)) == [("edited", 2)]


def test_report_renders_each_problem(engine):
    _chain(engine, 2)
    _rewrite(engine, 1, lambda b: b.__setitem__("question", "x"))
    text = verify_chain(engine).render()
    assert text.startswith("FAILED") and "edited" in text and "seq 1" in text
