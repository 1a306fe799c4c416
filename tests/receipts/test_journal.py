"""The started-answer journal: a row per answer in flight, gone with its receipt, and turned into an
``interrupted`` receipt at the next start only when the process that wrote it is gone (on SQLite and
PostgreSQL: the ``engine`` fixture)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import pytest
from sqlalchemy import select

from foundation.db import read_session
from foundation.errors import Conflict, InvalidInput
from foundation.processes import ProcessIdentity, current_process, process_token
from ragbudget_testing.synthetic_receipts import body
from receipts.chain import append_receipt, get_receipt, list_receipts, new_receipt_id
from receipts.journal import open_entry, pending, recover_interrupted
from receipts.models import ReceiptRow
from receipts.replay import check_regenerate
from receipts.verify import verify_chain


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


def statuses(engine: Any) -> list[tuple[str, str]]:
    with read_session(engine) as s:
        rows = s.execute(select(ReceiptRow.id, ReceiptRow.status).order_by(ReceiptRow.seq))
        return [(i, st) for i, st in rows]


def test_the_answers_receipt_takes_the_reserved_id_and_removes_the_row_in_one_transaction(engine):
    rid = new_receipt_id()
    open_entry(engine, rid, started())
    assert [e.id for e in pending(engine)] == [rid]
    stored = append_receipt(engine, body(), receipt_id=rid)
    assert stored.id == rid and pending(engine) == []


def test_a_row_whose_process_is_gone_becomes_one_interrupted_receipt_that_verifies(engine, dead):
    append_receipt(engine, body(question="before"))
    rid = new_receipt_id()
    open_entry(engine, rid, started(question="cut off"), owner=dead)
    [stored] = recover_interrupted(engine)
    assert stored.id == rid and pending(engine) == []
    got = get_receipt(engine, rid)
    assert (got["status"], got["output"], got["question"]) == ("interrupted", None, "cut off")
    assert got["error"]["code"] == "interrupted"
    assert got["extra"]["interrupted"]["pid"] == dead.pid
    assert got["plan"]["chosen_k"] == 2 and len(got["candidates"]) == 3  # what the model was shown
    assert verify_chain(engine).ok
    assert [r["id"] for r in list_receipts(engine, status="interrupted")[0]] == [rid]
    assert recover_interrupted(engine) == []  # nothing left; never twice


def test_rows_of_live_processes_and_of_other_hosts_are_left_alone(engine, dead):
    me = current_process()
    mine, elsewhere = new_receipt_id(), new_receipt_id()
    open_entry(engine, mine, started())  # this process: alive
    open_entry(engine, elsewhere, started(), owner=ProcessIdentity("another-host", dead.pid, dead.token))
    assert recover_interrupted(engine) == []
    assert {e.id for e in pending(engine)} == {mine, elsewhere}
    assert pending(engine)[0].host in (me.host, "another-host")


def test_a_reused_pid_is_not_taken_for_the_owner(engine):
    me = current_process()
    if not me.token:
        pytest.skip("no /proc: liveness by pid alone")
    rid = new_receipt_id()
    # Same pid as this live process, but another start time: the owner ended and the pid was reused.
    open_entry(engine, rid, started(), owner=ProcessIdentity(me.host, me.pid, me.token + "0"))
    assert [s.id for s in recover_interrupted(engine)] == [rid]


def test_concurrent_recoveries_record_each_row_once(engine, dead):
    ids = [new_receipt_id() for _ in range(3)]
    for rid in ids:
        open_entry(engine, rid, started(), owner=dead)
    results: list[list[Any]] = []
    threads = [threading.Thread(target=lambda: results.append(recover_interrupted(engine))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(s.id for r in results for s in r) == sorted(ids)
    assert sorted(statuses(engine)) == sorted((rid, "interrupted") for rid in ids)
    assert verify_chain(engine).ok


def test_an_answer_recorded_as_interrupted_cannot_append_a_second_receipt(engine, dead):
    rid = new_receipt_id()
    open_entry(engine, rid, started(), owner=dead)
    recover_interrupted(engine)
    with pytest.raises(Conflict):
        append_receipt(engine, body(), receipt_id=rid)
    assert statuses(engine) == [(rid, "interrupted")]


def test_a_journal_body_has_status_interrupted_and_no_output(engine):
    with pytest.raises(InvalidInput):
        open_entry(engine, new_receipt_id(), body())
    assert pending(engine) == []


def test_replay_of_an_interrupted_receipt_says_there_is_no_output_to_compare():
    check = check_regenerate(started(), regenerate=lambda _b: {}, current_environment=None)
    assert check.skipped and "no output to compare" in check.detail


def test_rows_of_a_host_declared_gone_are_recorded_and_this_host_cannot_be_declared_gone(engine):
    rid = new_receipt_id()
    open_entry(engine, rid, started(), owner=ProcessIdentity("retired-host", 4242, "boot/1"))
    assert recover_interrupted(engine) == []
    with pytest.raises(InvalidInput):
        recover_interrupted(engine, hosts_gone={current_process().host})
    assert [s.id for s in recover_interrupted(engine, hosts_gone={"retired-host"})] == [rid]


def test_receipts_recover_command_records_dead_rows_and_lists_the_rest(engine, settings, dead, monkeypatch,
                                                                       capsys):
    from app.cli.main import main

    monkeypatch.setenv("RAGBUDGET_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("RAGBUDGET_DATABASE_URL", settings.resolved_database_url)
    monkeypatch.setenv("RAGBUDGET_AUTH_ENABLED", "false")
    cut, live = new_receipt_id(), new_receipt_id()
    open_entry(engine, cut, started(), owner=dead)
    open_entry(engine, live, started())
    assert main(["receipts", "recover", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in out["recorded"]] == [cut] and [e["id"] for e in out["left"]] == [live]
    assert main(["receipts", "list", "--status", "interrupted", "--json"]) == 0
    assert cut in capsys.readouterr().out
