"""Every tamper kind against both audits: ``verify_chain`` (the walk) and ``check_chain`` (replay's
step 1, which must look at the real neighbours, not seq +- 1); nonsense verify options refused.
SQLite and PostgreSQL."""

import json

import pytest
from sqlalchemy import delete, select, update

from app.cli.main import main
from foundation.db import WriterLock, write_transaction
from foundation.errors import InvalidInput
from ragbudget_testing.synthetic_receipts import body
from receipts.canonical import canonical_body
from receipts.chain import append_receipt, get_receipt_row, receipt_hash
from receipts.models import ReceiptDocument, ReceiptRow
from receipts.replay import check_chain
from receipts.verify import verify_chain


def _chain(engine, n=5):
    return [append_receipt(engine, body(question=f"question {i}")) for i in range(n)]


def _delete(engine, *seqs):
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        s.execute(delete(ReceiptDocument).where(ReceiptDocument.receipt_seq.in_(seqs)))
        s.execute(delete(ReceiptRow).where(ReceiptRow.seq.in_(seqs)))


def _edit(engine, seq, *, rehash):
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        row = s.scalars(select(ReceiptRow).where(ReceiptRow.seq == seq)).one()
        b = json.loads(row.body)
        b["question"] = "forged"
        if rehash:
            b["hash"] = receipt_hash(b)
            row.hash = b["hash"]
        row.body = canonical_body(b).decode("utf-8")


def _swap(engine, x, y):
    cols = ("id", "created_at", "status", "prev_hash", "hash", "body")
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        a, b = (s.scalars(select(ReceiptRow).where(ReceiptRow.seq == n)).one() for n in (x, y))
        va, vb = ({c: getattr(r, c) for c in cols} for r in (a, b))
        for r, tmp in ((a, "x"), (b, "y")):
            r.id, r.prev_hash, r.hash = tmp, tmp, tmp
        s.flush()
        for r, v in ((a, vb), (b, va)):
            for c in cols:
                setattr(r, c, v[c])


def _renumber(engine):
    """Delete receipt 3 and move 4 and 5 down to close the gap (seq column only)."""
    _delete(engine, 3)
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        docs = [(d.receipt_seq, d.document_id, d.version) for d in
                s.scalars(select(ReceiptDocument).where(ReceiptDocument.receipt_seq.in_((4, 5))))]
        s.execute(delete(ReceiptDocument).where(ReceiptDocument.receipt_seq.in_((4, 5))))
        for old in (4, 5):
            s.execute(update(ReceiptRow).where(ReceiptRow.seq == old).values(seq=old - 1))
        s.add_all(ReceiptDocument(receipt_seq=seq - 1, document_id=d, version=v) for seq, d, v in docs)


def _link(engine, receipt_id):
    row = get_receipt_row(engine, receipt_id)
    return {c.name: c for c in check_chain(engine, row, json.loads(row.body))}


def test_intact_chain_every_receipt_links(engine):
    stored = _chain(engine)
    for r in stored:
        assert all(c.ok for c in _link(engine, r.id).values())
    assert _link(engine, stored[-1].id)["chain_link"].detail.endswith("(head)")


def test_edited(engine):
    stored = _chain(engine)
    _edit(engine, 3, rehash=False)
    assert [(p.kind, p.seq) for p in verify_chain(engine).problems] == [("edited", 3)]
    assert not _link(engine, stored[2].id)["receipt_hash"].ok


def test_rehashed(engine):
    stored = _chain(engine)
    _edit(engine, 3, rehash=True)
    assert [(p.kind, p.seq) for p in verify_chain(engine).problems] == [("broken_link", 4)]
    assert not _link(engine, stored[2].id)["chain_link"].ok  # its successor no longer links to it
    assert not _link(engine, stored[3].id)["chain_link"].ok


def test_deleted_middle(engine):
    stored = _chain(engine)
    _delete(engine, 3)
    assert [(p.kind, p.seq) for p in verify_chain(engine).problems] == [("missing", 3)]
    before, after = _link(engine, stored[1].id)["chain_link"], _link(engine, stored[3].id)["chain_link"]
    assert not before.ok and "3 missing" in before.detail and "(head)" not in before.detail
    assert not after.ok and "3 missing" in after.detail


def test_deleted_two_in_the_middle(engine):
    stored = _chain(engine)
    _delete(engine, 2, 3)
    check = _link(engine, stored[0].id)["chain_link"]
    assert not check.ok and "2..3 missing" in check.detail


def test_deleted_tail_with_expect_head(engine):
    stored = _chain(engine)
    _delete(engine, 5)
    report = verify_chain(engine, expected_head=stored[-1].hash)
    assert [(p.kind, p.seq) for p in report.problems] == [("missing", None)]


def test_swapped(engine):
    stored = _chain(engine)
    _swap(engine, 2, 3)
    assert [(p.kind, p.seq) for p in verify_chain(engine).problems] == [("reordered", 2), ("reordered", 3)]
    for r in stored[1:3]:
        check = _link(engine, r.id)["chain_link"]
        assert not check.ok and "records position" in check.detail


def test_renumbered(engine):
    stored = _chain(engine)
    _renumber(engine)
    kinds = {p.kind for p in verify_chain(engine).problems}
    assert "reordered" in kinds and "broken_link" in kinds
    assert not _link(engine, stored[1].id)["chain_link"].ok  # its next neighbour does not link to it
    assert not _link(engine, stored[3].id)["chain_link"].ok  # stored at 3, records 4


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"batch_size": -1}, {"batch_size": 10**9},
                                    {"batch_size": True}, {"expected_head": ""},
                                    {"expected_head": "sha256:xyz"}])
def test_verify_refuses_nonsense_options(engine, kwargs):
    _chain(engine, 2)
    with pytest.raises(InvalidInput):
        verify_chain(engine, **kwargs)


@pytest.mark.parametrize("argv", [["--batch-size", "0"], ["--batch-size", "-5"], ["--batch-size", "x"],
                                  ["--batch-size", "²"], ["--batch-size", "99999999999999999999999"],
                                  ["--expect-head", "nonsense"]])
def test_cli_verify_refuses_nonsense_options_with_exit_2(engine, settings, monkeypatch, capsys, argv):
    _chain(engine, 3)
    _edit(engine, 2, rehash=False)  # a tampered chain: no option may make it pass
    monkeypatch.setenv("RAGBUDGET_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("RAGBUDGET_DATABASE_URL", settings.resolved_database_url)
    with pytest.raises(SystemExit) as exc:
        main(["receipts", "verify", *argv]) if argv[0] == "--batch-size" else _exit(main(
            ["receipts", "verify", *argv]))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip()


def _exit(code):
    raise SystemExit(code)
