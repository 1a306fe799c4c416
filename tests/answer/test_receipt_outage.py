"""A served answer's receipt survives a database outage: the client is told it is pending, and it is
appended once, with the streamed output, when the database is back (or at the next start).

The PostgreSQL tests stop and start a test-owned cluster (:mod:`tests.pg_cluster`), never the
shared server, in the middle of a streaming answer: the fake generator
(:class:`tests.api.fakes.EchoGenerator`) holds after its first token until the test has stopped
the cluster, then finishes the answer while the database is away. On SQLite another connection
holds the database locked through the answer's end; injected faults give a commit whose
acknowledgement was lost and a full disk under the spool.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from app.answering.receipt_wiring import record_interrupted_answers
from app.api.app import create_app
from app.settings import get_settings
from foundation.db import read_session
from generation.base import TokenEvent, TokenStream
from latency_model.calibration import calibrate
from latency_model.grid import quick_grid
from latency_model.profile import Profile
from receipts import chain as chain_mod
from receipts import spool as spool_mod
from receipts.chain import get_receipt
from receipts.journal import pending
from receipts.models import ReceiptRow
from receipts.verify import verify_chain
from tests.answer.conftest import free_port, sse_events
from tests.api.conftest import make_services
from tests.api.fakes import CharTokenizer, EchoGenerator, wrapped
from tests.latency_model.conftest import FakeTimer, no_cpu_probe
from tests.pg_cluster import PgCluster, pg_cluster  # noqa: F401 - the fixture

REPLY = "the pump is painted vermilion"
DOC = "Zebrafish sentinel paragraph: the circulation pump is painted vermilion."
ASK = {"question": "What colour is the pump?", "ttft_budget_ms": 60_000.0, "max_new_tokens": 64}


class PausingGenerator(EchoGenerator):
    """:class:`EchoGenerator` that, after its first token, waits for ``resume`` (the test takes the
    database away meanwhile)."""

    def __init__(self, tokenizer: CharTokenizer, reply: str) -> None:
        super().__init__(tokenizer, reply)
        self.first_token = threading.Event()
        self.resume = threading.Event()

    def stream(self, prompt_ids: list[int], **kwargs: Any) -> TokenStream:
        def events(inner: TokenStream) -> Iterator[TokenEvent]:
            for ev in inner:
                yield ev
                if not self.first_token.is_set():
                    self.first_token.set()
                    self.resume.wait(60)

        return wrapped(super().stream(prompt_ids, **kwargs), events)


@pytest.fixture(scope="module")
def profile() -> Profile:
    """A profile fitted on the fake timer (its identity is the fake generator's)."""
    return calibrate(FakeTimer(), grid=quick_grid(8192, [200]), seed=3, progress=False,
                     cpu_probe=no_cpu_probe)


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn (lifespan on: the start drains the spool) on a free port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-outage-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    """Poll ``condition`` until it holds (a wait for background work, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.1)


def receipt_rows(engine: Any) -> list[tuple[str, str]]:
    """``(id, status)`` of every receipt in chain order."""
    with read_session(engine) as s:
        return [(i, st) for i, st in s.execute(select(ReceiptRow.id, ReceiptRow.status)
                                                .order_by(ReceiptRow.seq))]


def appended(engine: Any, receipt_id: str) -> bool:
    try:
        with read_session(engine) as s:
            return bool(s.scalar(select(func.count()).where(ReceiptRow.id == receipt_id)))
    except Exception:  # the database is not back yet
        return False


def stream_through_outage(base: str, cluster: PgCluster, gen: PausingGenerator) -> list[tuple[str, str]]:
    """Stream one answer; after its first token stop the cluster, then let the answer finish."""
    events: list[tuple[str, str]] = []
    with httpx.stream("POST", f"{base}/v1/answer", json={**ASK, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for name, data in sse_events(r.iter_lines()):
            events.append((name, data))
            if name == "token" and not gen.resume.is_set():
                cluster.stop("fast")
                gen.resume.set()
    return events


def pg_services(cluster: PgCluster, root: Path, profile: Profile, gen: EchoGenerator) -> Any:
    settings = get_settings(data_dir=root / "data", database_url=cluster.create_database(),
                            auth_enabled=False)
    return make_services(settings, profile, gen)


def ingest(base: str) -> None:
    r = httpx.post(f"{base}/v1/documents", json={"id": "pump.txt", "text": DOC}, timeout=60)
    assert r.status_code == 201, r.text


def final_of(events: list[tuple[str, str]]) -> tuple[dict[str, Any], str]:
    """The final event's summary and the text the client was streamed."""
    assert [n for n, _ in events][-2:] == ["final", "message"] and events[-1][1] == "[DONE]"
    streamed = "".join(json.loads(d)["text"] for n, d in events if n == "token")
    return json.loads(events[-2][1]), streamed


@pytest.mark.postgres
def test_a_database_stop_mid_stream_gives_a_pending_receipt_appended_once_when_it_is_back(
        pg_cluster: PgCluster, tmp_path: Path, profile: Profile) -> None:  # noqa: F811
    gen = PausingGenerator(CharTokenizer(), REPLY)
    services = pg_services(pg_cluster, tmp_path, profile, gen)
    app = create_app(services=services)
    try:
        with serve(app) as base:
            ingest(base)
            final, streamed = final_of(stream_through_outage(base, pg_cluster, gen))
            assert (final["status"], final["receipt_status"], streamed) == ("ok", "pending", REPLY)
            rid = final["receipt_id"]
            assert rid and rid in final["receipt_error"]
            pg_cluster.start()
            wait_for(lambda: appended(services.engine, rid), "the spooled receipt to be appended")
            r = httpx.get(f"{base}/v1/receipts/{rid}", timeout=60)
            assert r.status_code == 200
            metrics = httpx.get(f"{base}/metrics", timeout=60).text
        assert 'ragbudget_answer_receipts_total{status="pending"} 1.0' in metrics
        body = get_receipt(services.engine, rid)
        assert body["status"] == "ok" and body["output"]["text"] == streamed
        assert body["extra"]["delayed_append"]["reason"]
        assert receipt_rows(services.engine) == [(rid, "ok")]  # exactly once, nothing interrupted
        assert pending(services.engine) == []  # the journal row went with the receipt
        assert verify_chain(services.engine).ok
        assert record_interrupted_answers(services) == 0  # a later start finds nothing cut off
        assert receipt_rows(services.engine) == [(rid, "ok")]
    finally:
        app.state.pipeline.receipts.drainer.stop()
        if not pg_cluster.running():
            pg_cluster.start()
        services.close()


@pytest.mark.postgres
def test_a_receipt_spooled_before_a_restart_is_appended_at_the_next_start_never_interrupted(
        pg_cluster: PgCluster, tmp_path: Path, profile: Profile) -> None:  # noqa: F811
    gen = PausingGenerator(CharTokenizer(), REPLY)
    services = pg_services(pg_cluster, tmp_path, profile, gen)
    first = create_app(services=services)
    try:
        with serve(first) as base:
            ingest(base)
            final, streamed = final_of(stream_through_outage(base, pg_cluster, gen))
            first.state.pipeline.receipts.drainer.stop()  # this process ends before the database is back
        assert final["receipt_status"] == "pending"
        rid = final["receipt_id"]
        pg_cluster.start()
        again = make_services(services.settings, profile, EchoGenerator(CharTokenizer(), REPLY))
        try:
            with TestClient(create_app(services=again)) as client:  # the lifespan: drain, then sweep
                got = client.get(f"/v1/receipts/{rid}")
            assert got.status_code == 200 and got.json()["receipt"]["status"] == "ok"
            assert got.json()["receipt"]["output"]["text"] == streamed
            assert receipt_rows(again.engine) == [(rid, "ok")]
            assert verify_chain(again.engine).ok
        finally:
            again.close()
    finally:
        if not pg_cluster.running():
            pg_cluster.start()
        services.close()


@pytest.fixture
def sqlite_app(tmp_path: Path, profile: Profile) -> Iterator[tuple[TestClient, Any]]:
    settings = get_settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
                            auth_enabled=False)
    services = make_services(settings, profile, EchoGenerator(CharTokenizer(), REPLY))
    app = create_app(services=services)
    with TestClient(app) as client:
        r = client.post("/v1/documents", json={"id": "pump.txt", "text": DOC})
        assert r.status_code == 201, r.text
        yield client, services
    app.state.pipeline.receipts.drainer.stop()
    services.close()


def _away(*_a: Any, **_k: Any) -> Any:
    raise OperationalError("INSERT INTO receipts", {}, ConnectionRefusedError("connection refused"))


def test_a_commit_whose_acknowledgement_was_lost_is_not_appended_twice(sqlite_app, monkeypatch):
    client, services = sqlite_app
    real = chain_mod.append_receipt

    def committed_then_dropped(*a: Any, **k: Any) -> Any:
        real(*a, **k)
        raise OperationalError("COMMIT", {}, ConnectionResetError("server closed the connection"))

    monkeypatch.setattr(chain_mod, "append_receipt", committed_then_dropped)
    r = client.post("/v1/answer", json=ASK)
    assert r.status_code == 200 and r.json()["receipt_status"] == "pending"
    rid = r.json()["receipt_id"]
    drainer = client.app.state.pipeline.receipts.drainer  # type: ignore[attr-defined]
    wait_for(lambda: not drainer.spool.ids(), "the spool to drain")
    assert receipt_rows(services.engine) == [(rid, "ok")]
    assert verify_chain(services.engine).ok


def test_a_spool_that_cannot_be_written_fails_the_receipt_clearly_and_is_counted(sqlite_app, monkeypatch):
    client, services = sqlite_app

    def disk_full(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(chain_mod, "append_receipt", _away)
    monkeypatch.setattr(spool_mod.os, "fsync", disk_full)
    with client.stream("POST", "/v1/answer", json={**ASK, "stream": True}) as r:
        events = list(sse_events(r.iter_lines()))
    final, streamed = final_of(events)
    assert (final["status"], final["receipt_status"], streamed) == ("ok", "failed", REPLY)
    assert "nor spooled" in final["receipt_error"] and "No space left" in final["receipt_error"]
    # the journal row stays: the next start records the answer as interrupted under this id
    assert [e.id for e in pending(services.engine)] == [final["receipt_id"]]
    monkeypatch.undo()
    assert 'ragbudget_answer_receipts_total{status="failed"} 1.0' in client.get("/metrics").text
    assert receipt_rows(services.engine) == []


def test_a_written_receipt_says_written(sqlite_app):
    client, services = sqlite_app
    r = client.post("/v1/answer", json=ASK)
    assert r.json()["receipt_status"] == "written" and r.json()["receipt_error"] is None
    assert receipt_rows(services.engine) == [(r.json()["receipt_id"], "ok")]


def test_the_start_appends_a_spooled_receipt_before_its_sweep_could_record_it_interrupted(tmp_path):
    from app.services import Services
    from foundation.processes import ProcessIdentity, current_process, process_token
    from ragbudget_testing.synthetic_receipts import body
    from receipts.chain import new_receipt_id
    from receipts.journal import open_entry
    from receipts.spool import SPOOL_DIRNAME, ReceiptSpool

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = ProcessIdentity(current_process().host, child.pid, process_token(child.pid))
    child.wait(10)
    services = Services(get_settings(data_dir=tmp_path / "data", auth_enabled=False,
                                     database_url=f"sqlite:///{tmp_path / 'db.sqlite'}"))
    try:
        rid = new_receipt_id()
        journal = body(status="interrupted")
        journal["output"] = None
        open_entry(services.engine, rid, journal, owner=dead)  # its process is gone: sweepable
        ReceiptSpool(services.data_dir / SPOOL_DIRNAME).put(rid, body(), "2026-01-02T03:04:05.000006+00:00")
        assert record_interrupted_answers(services) == 0
        assert receipt_rows(services.engine) == [(rid, "ok")] and pending(services.engine) == []
    finally:
        services.close()


def test_a_sqlite_database_locked_through_the_answers_end_gives_a_pending_receipt_appended_once(
        tmp_path: Path, profile: Profile) -> None:
    import sqlite3

    db = tmp_path / "db.sqlite"
    gen = PausingGenerator(CharTokenizer(), REPLY)
    settings = get_settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{db}",
                            auth_enabled=False, sqlite_busy_timeout_ms=20)
    services = make_services(settings, profile, gen)
    app = create_app(services=services)
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    try:
        with serve(app) as base:
            ingest(base)
            events: list[tuple[str, str]] = []
            with httpx.stream("POST", f"{base}/v1/answer", json={**ASK, "stream": True}, timeout=120) as r:
                for name, data in sse_events(r.iter_lines()):
                    events.append((name, data))
                    if name == "token" and not gen.resume.is_set():
                        holder.execute("BEGIN EXCLUSIVE")  # another writer holds the database
                        gen.resume.set()
            final, streamed = final_of(events)
            assert (final["status"], final["receipt_status"], streamed) == ("ok", "pending", REPLY)
            holder.execute("ROLLBACK")
            rid = final["receipt_id"]
            wait_for(lambda: appended(services.engine, rid), "the spooled receipt to be appended")
        body = get_receipt(services.engine, rid)
        assert body["status"] == "ok" and body["output"]["text"] == streamed
        assert receipt_rows(services.engine) == [(rid, "ok")] and pending(services.engine) == []
        assert verify_chain(services.engine).ok
    finally:
        holder.close()
        app.state.pipeline.receipts.drainer.stop()
        services.close()


def test_the_app_starts_while_the_database_is_away_and_its_spooled_receipts_wait(tmp_path):
    from app.services import Services
    from ragbudget_testing.synthetic_receipts import body
    from receipts.chain import new_receipt_id
    from receipts.spool import SPOOL_DIRNAME, ReceiptSpool

    settings = get_settings(data_dir=tmp_path / "data", auth_enabled=False,
                            database_url=f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none")
    rid = new_receipt_id()
    ReceiptSpool(settings.data_dir / SPOOL_DIRNAME).put(rid, body(), "2026-01-02T03:04:05.000006+00:00")
    services = Services(settings)
    app = create_app(services=services)
    drainer = app.state.pipeline.receipts.drainer
    try:
        with TestClient(app) as client:
            assert client.get("/v1/receipts").status_code == 503  # the app runs; the database is away
            assert drainer.running and drainer.spool.ids() == {rid}  # retried in the background
    finally:
        drainer.stop()
