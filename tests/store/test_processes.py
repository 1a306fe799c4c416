"""Several processes against one database: concurrent ingests, and kill -9 inside the write transaction.

Runs on SQLite and PostgreSQL. The kill lands inside the open write transaction
through the store's test-only pause hook (``RAGBUDGET_TEST_PAUSE_IN_COMMIT_S``), after
documents, versions, chunks and the revision row have been inserted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import func, select

from foundation.db import read_session
from retrieval.chunking import ChunkerConfig
from retrieval.models import Chunk, Document, DocumentVersion, Revision
from retrieval.store import PAUSE_ENV, PAUSE_MARKER_ENV, ingest_batch, latest_revision, verify_store
from tests.store.ingest_worker import WordTokenizer, batch_items

REPO = Path(__file__).resolve().parents[2]


def spawn(db_url: str, name: str, batches: int, docs: int, go: Path | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "tests.store.ingest_worker", db_url, name, str(batches), str(docs)]
    return subprocess.Popen(args + ([str(go)] if go else []), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def counts(engine) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    with read_session(engine) as s:
        return tuple(int(s.scalar(select(func.count()).select_from(m)))
                     for m in (Revision, Document, DocumentVersion, Chunk))


def test_two_processes_ingesting_at_once_both_succeed_with_increasing_revisions(engine, db_url, tmp_path):
    go = tmp_path / "go"
    slow = {PAUSE_ENV: "0.05"}  # hold each transaction a little so the writers really collide
    procs = [spawn(db_url, name, 4, 3, go, slow) for name in ("w1", "w2")]
    time.sleep(1.0)
    go.touch()
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outputs]
    lines = [[json.loads(x) for x in out.splitlines()] for out, _ in outputs]
    for worker in lines:
        revisions = [x["revision"] for x in worker]
        assert revisions == sorted(revisions) and len(set(revisions)) == 4
    all_revisions = sorted(x["revision"] for worker in lines for x in worker)
    assert all_revisions == list(range(1, 9))
    assert sorted(x["shared_version"] for worker in lines for x in worker) == list(range(1, 9))
    with read_session(engine) as s:
        assert latest_revision(s) == 8
        assert verify_store(s) == []


def test_kill_9_inside_the_write_transaction_leaves_the_previous_revision(engine, db_url, tmp_path):
    ingest_batch(engine, batch_items("base", 0, 5), tokenizer=WordTokenizer(),
                 chunker_config=ChunkerConfig(32, 4))
    before = counts(engine)
    marker = tmp_path / "in-transaction"
    proc = spawn(db_url, "big", 1, 300, env={PAUSE_ENV: "120", PAUSE_MARKER_ENV: str(marker)})
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the worker never reached the write transaction"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert counts(engine) == before
    with read_session(engine) as s:
        assert latest_revision(s) == 1
        assert verify_store(s) == []
    # Restart: the same batch now commits as the next revision.
    restarted = spawn(db_url, "big", 1, 300)
    out, err = restarted.communicate(timeout=240)
    assert restarted.returncode == 0, err[-2000:]
    assert json.loads(out.splitlines()[-1])["revision"] == 2
    with read_session(engine) as s:
        assert verify_store(s) == []
