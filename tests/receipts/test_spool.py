"""The receipt spool: a finished receipt the database could not take is kept on disk and appended
once, idempotent by receipt id, the chain intact (on SQLite and PostgreSQL: the ``engine`` fixture)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from foundation.db import read_session
from foundation.processes import ProcessIdentity, current_process, process_token
from ragbudget_testing.synthetic_receipts import body
from receipts import spool as spool_mod
from receipts.chain import append_receipt, get_receipt, new_receipt_id
from receipts.journal import open_entry, pending, recover_interrupted
from receipts.models import ReceiptRow
from receipts.spool import SET_ASIDE_DIRNAME, ReceiptSpool, SpoolDrainer, content_of
from receipts.verify import verify_chain

EARLY = "2026-01-02T03:04:05.000006+00:00"


def started(**kwargs: Any) -> dict[str, Any]:
    """A journal body: a valid receipt body with status ``interrupted`` and no output."""
    b = body(status="interrupted", **kwargs)
    b["output"] = None
    return b


@pytest.fixture(scope="module")
def dead() -> ProcessIdentity:
    """The identity of a process of this host that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    token = process_token(child.pid)
    child.wait(10)
    return ProcessIdentity(host=current_process().host, pid=child.pid, token=token)


@pytest.fixture
def spool(tmp_path: Path) -> ReceiptSpool:
    return ReceiptSpool(tmp_path / "spool")


def rows(engine: Any) -> list[tuple[str, str, str]]:
    """``(id, status, created_at)`` of every receipt, in chain order."""
    with read_session(engine) as s:
        return [tuple(r) for r in s.execute(select(ReceiptRow.id, ReceiptRow.status,
                                                   ReceiptRow.created_at).order_by(ReceiptRow.seq))]


def test_a_spooled_receipt_is_appended_once_under_its_id_and_its_file_removed(engine, spool):
    rid, b = new_receipt_id(), body(question="spooled")
    spool.put(rid, b, EARLY)
    report = spool.drain(engine)
    assert [s.id for s in report.appended] == [rid] and report.left == 0 and report.error is None
    assert spool.ids() == set()
    got = get_receipt(engine, rid)
    assert content_of(got) == content_of(b) and got["status"] == "ok"
    assert spool.drain(engine).appended == []  # nothing left: never twice
    assert [r[0] for r in rows(engine)] == [rid]
    assert verify_chain(engine).ok


def test_a_receipt_whose_first_append_committed_is_not_written_again(engine, spool):
    rid = new_receipt_id()
    b = body(question="committed, then the connection dropped")
    append_receipt(engine, dict(b), receipt_id=rid)
    spool.put(rid, b, EARLY)
    report = spool.drain(engine)
    assert report.appended == [] and report.already == [rid] and spool.ids() == set()
    assert [r[0] for r in rows(engine)] == [rid]
    assert verify_chain(engine).ok


def test_a_late_receipt_keeps_its_created_at_and_the_chain_records_append_order(engine, spool):
    late, newer = new_receipt_id(), new_receipt_id()
    spool.put(late, body(question="late"), EARLY)
    append_receipt(engine, body(question="newer"), receipt_id=newer)
    spool.drain(engine)
    (first_id, _, first_at), (second_id, _, second_at) = rows(engine)
    assert (first_id, second_id) == (newer, late)
    assert second_at == EARLY < first_at == get_receipt(engine, newer)["created_at"]
    assert get_receipt(engine, late)["created_at"] == EARLY
    assert verify_chain(engine).ok


def test_the_spooled_receipt_takes_its_journal_row_and_is_never_swept_as_interrupted(engine, spool, dead):
    rid = new_receipt_id()
    open_entry(engine, rid, started(question="cut off?"), owner=dead)
    spool.put(rid, body(question="cut off?"), EARLY)
    assert recover_interrupted(engine, spooled=spool.ids()) == []  # the drain failed: left for it
    assert [e.id for e in pending(engine)] == [rid]
    spool.drain(engine)
    assert pending(engine) == []
    assert rows(engine) == [(rid, "ok", EARLY)]
    assert recover_interrupted(engine) == []
    assert verify_chain(engine).ok


def test_a_torn_spool_file_is_set_aside_and_never_appended(engine, spool):
    rid = new_receipt_id()
    path = spool.put(rid, body(), EARLY)
    path.write_bytes(path.read_bytes()[:-40])
    report = spool.drain(engine)
    assert report.appended == [] and spool.ids() == set()
    assert (spool.directory / SET_ASIDE_DIRNAME / path.name).exists()
    assert rows(engine) == []


def test_an_edited_spool_file_is_set_aside(engine, spool):
    rid = new_receipt_id()
    path = spool.put(rid, body(question="what was asked"), EARLY)
    record = json.loads(path.read_bytes())
    record["content"]["question"] = "something else"
    path.write_text(json.dumps(record))
    spool.drain(engine)
    assert rows(engine) == [] and (spool.directory / SET_ASIDE_DIRNAME / path.name).exists()


def test_a_spool_write_that_fails_leaves_no_file(spool, monkeypatch):
    def full(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spool_mod.os, "fsync", full)
    with pytest.raises(OSError):
        spool.put(new_receipt_id(), body(), EARLY)
    assert list(spool.directory.iterdir()) == []


def test_the_drain_stops_at_a_database_error_and_keeps_the_files(engine, spool, monkeypatch):
    ids = [new_receipt_id() for _ in range(2)]
    for rid in ids:
        spool.put(rid, body(), EARLY)

    def away(*_a: Any, **_k: Any) -> Any:
        raise OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))

    monkeypatch.setattr(spool_mod, "append_spooled", away)
    report = spool.drain(engine)
    assert report.left == 2 and "connection refused" in (report.error or "")
    assert spool.ids() == set(ids) and rows(engine) == []


def test_the_background_drain_retries_until_the_database_is_back(engine, spool, monkeypatch):
    rid = new_receipt_id()
    spool.put(rid, body(), EARLY)
    real, failures = spool_mod.append_spooled, {"n": 0}

    def flaky(*a: Any, **k: Any) -> Any:
        if failures["n"] < 3:
            failures["n"] += 1
            raise OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))
        return real(*a, **k)

    monkeypatch.setattr(spool_mod, "append_spooled", flaky)
    done = threading.Event()
    drainer = SpoolDrainer(spool, engine, first_delay_s=0.001, max_delay_s=0.01,
                           on_drained=lambda r: done.set() if r.appended else None)
    drainer.kick()
    try:
        assert done.wait(60)
    finally:
        drainer.stop()
    assert failures["n"] == 3 and rows(engine) == [(rid, "ok", EARLY)] and spool.ids() == set()
