"""Shutdown and crash: every answer that reached a client has a receipt and the chain verifies.

SIGTERM during streaming answers: the server exits within RAGBUDGET_SHUTDOWN_GRACE_S + 1 s with
the answers' receipts (ok or cancelled). SIGKILL during a streaming answer: nothing is written
then, but the answer's journal row is there, and the next start records it as ``interrupted``
(on SQLite and PostgreSQL). The server is a subprocess (tests/api/fake_server.py); every wait is
bounded."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from app.answering.receipt_wiring import replay_receipt
from foundation.db import make_engine, read_session
from latency_model.profile import Profile
from receipts.chain import get_receipt
from receipts.journal import pending
from receipts.models import ReceiptRow
from receipts.verify import verify_chain
from tests.api.conftest import api_settings, make_services

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(root: Path, port: int, database_url: str | None = None) -> subprocess.Popen[str]:
    """``tests.api.fake_server`` on ``root`` (and ``database_url``), once ``/healthz`` answers 200."""
    env = {**os.environ, "RAGBUDGET_SHUTDOWN_GRACE_S": str(GRACE_S)}
    env.pop("RAGBUDGET_DATABASE_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "tests.api.fake_server", str(root), str(port),
                             *([database_url] if database_url else [])],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.communicate()[0][-3000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server did not start: " + proc.communicate(timeout=10)[0][-3000:])
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[str]) -> str:
    """Kill ``proc`` if it still runs; its output (empty when it was read already)."""
    if proc.poll() is None:
        proc.kill()
    if proc.stdout is None or proc.stdout.closed:
        proc.wait(10)
        return ""
    return proc.communicate(timeout=10)[0] or ""


def test_sigterm_during_three_streaming_answers_exits_within_grace_with_three_receipts(tmp_path):
    port = _free_port()
    proc = _start_server(tmp_path, port)
    base = f"http://127.0.0.1:{port}"
    try:
        got_bytes = [threading.Event() for _ in range(3)]

        def ask(i: int) -> None:
            body = {"question": f"what colour is the pump {i}", "ttft_budget_ms": 60_000, "stream": True,
                    "max_new_tokens": 1000}
            try:
                # A read timeout longer than the test, so no client leaves before the signal.
                with httpx.stream("POST", f"{base}/v1/answer", json=body,
                                  timeout=httpx.Timeout(10.0, read=120.0)) as r:
                    for _ in r.iter_bytes():
                        got_bytes[i].set()
            except httpx.HTTPError:
                pass

        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        # The fake model runs three answers at once (max_running 3): all three stream.
        first_bytes_by = time.monotonic() + 30
        while not all(e.is_set() for e in got_bytes):
            assert time.monotonic() < first_bytes_by, "not every answer started streaming"
            time.sleep(0.05)
        streaming = [e.is_set() for e in got_bytes]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=GRACE_S + 30)
        elapsed = time.monotonic() - t0
        assert elapsed <= GRACE_S + 1.0, (elapsed, out[-2000:])
        for t in threads:
            t.join(10)
    finally:
        _stop(proc)
    engine = make_engine(f"sqlite:///{tmp_path / 'api.db'}")
    try:
        with read_session(engine) as s:
            statuses = [r for (r,) in s.execute(select(ReceiptRow.status).order_by(ReceiptRow.seq))]
        assert set(statuses) <= {"ok", "cancelled"} and statuses, statuses
        assert verify_chain(engine).ok
        assert pending(engine) == []  # each journal row went with its answer's receipt
        # The three answers (1000 tokens at 50 ms each) were all streaming at the signal: all
        # three are cancelled after the grace, each with its receipt.
        assert statuses == ["cancelled"] * 3, statuses
        assert streaming.count(True) == 3
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_sigkill_during_a_streaming_answer_is_recorded_as_interrupted_at_the_next_start(
        tmp_path: Path, request: pytest.FixtureRequest, backend: str, api_profile: Profile) -> None:
    db_url = (f"sqlite:///{tmp_path / 'api.db'}" if backend == "sqlite"
              else str(request.getfixturevalue("pg_url")))
    port = _free_port()
    proc = _start_server(tmp_path, port, db_url)
    got_bytes, question = threading.Event(), "what colour is the pump"

    def ask() -> None:
        body = {"question": question, "ttft_budget_ms": 60_000, "stream": True, "max_new_tokens": 1000}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/answer", json=body,
                              timeout=httpx.Timeout(10.0, read=60.0)) as r:
                for _ in r.iter_bytes():
                    got_bytes.set()
        except httpx.HTTPError:
            pass

    client = threading.Thread(target=ask, daemon=True)
    try:
        client.start()
        assert got_bytes.wait(30), "the answer did not start streaming"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        client.join(10)
    finally:
        _stop(proc)
    engine = make_engine(db_url)
    try:
        with read_session(engine) as s:
            assert s.scalars(select(ReceiptRow.id)).all() == []  # SIGKILL: nothing written then
        [entry] = pending(engine)
        assert entry.pid == proc.pid
        restarted = _start_server(tmp_path, _free_port(), db_url)  # its start records the answer
        _stop(restarted)
        with read_session(engine) as s:
            rows = s.execute(select(ReceiptRow.id, ReceiptRow.status)).all()
        assert [tuple(r) for r in rows] == [(entry.id, "interrupted")]
        assert pending(engine) == []
        body = get_receipt(engine, entry.id)
        assert body["question"] == question and body["output"] is None
        assert body["error"]["code"] == "interrupted" and body["extra"]["interrupted"]["pid"] == proc.pid
        assert body["candidates"] and body["prompt"]["prompt_tokens"] > 0
        assert verify_chain(engine).ok
    finally:
        engine.dispose()
    # Replay shows what the model was shown; there is no output to compare.
    services = make_services(api_settings(tmp_path, database_url=db_url, auth_enabled=False), api_profile)
    try:
        report = replay_receipt(services, entry.id, regenerate=True)
    finally:
        services.close()
    statuses = {c.name: c.status for c in report.checks}
    assert report.ok and statuses == {"receipt_hash": "ok", "chain_link": "ok", "corpus_root": "ok",
                                      "retrieval": "ok", "embedder": "ok", "stored_chunks": "ok",
                                      "prompt": "ok", "regenerate": "skipped"}, report.render()
    assert "no output to compare" in report.check("regenerate").detail
    env = {**os.environ, "RAGBUDGET_DATABASE_URL": db_url, "RAGBUDGET_DATA_DIR": str(tmp_path / "data")}
    cli = Path(sys.executable).with_name("ragbudget")
    verify = subprocess.run([str(cli), "receipts", "verify"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
