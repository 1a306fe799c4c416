"""The demo's ingest step goes through the ingest service (no CLI re-parse) and is resumable."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli.demo_cmds import DemoState, _ingest
from app.ingest import IngestService
from foundation.db import read_session
from retrieval.corpus import FetchResult
from retrieval.store import latest_revision, state_at


@pytest.fixture
def fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pages = tmp_path / "postgres-docs-15.18"
    pages.mkdir()
    (pages / "wal.html").write_text("<html><body><p>WAL archiving uses archive_command.</p></body></html>")
    (pages / "vacuum.html").write_text("<html><body><p>Autovacuum removes dead tuples.</p></body></html>")

    def fake_fetch(self: IngestService, version: str, deb: Path | None = None) -> FetchResult:
        return FetchResult(str(pages), 2, version, "postgresql-doc-15.deb", "sha256:" + "0" * 64, False)

    monkeypatch.setattr(IngestService, "fetch_postgres_docs", fake_fetch)
    return pages


def test_demo_ingest_stores_the_pages_once_and_records_the_revision(
        fetched, services_factory, store_settings, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    services = services_factory(store_settings)
    state = DemoState(tmp_path / "demo-state.json", restart=False)
    _ingest(services, state, "15.18")
    with read_session(services.engine) as s:
        head = latest_revision(s)
        live = sorted(v.document_id for v in state_at(s, head))
    assert head == 1 and live == ["vacuum.html", "wal.html"]
    assert state.get("ingested_15.18") == 1
    assert "revision 1 (previous 0): added 2" in capsys.readouterr().out
    _ingest(services, DemoState(tmp_path / "demo-state.json", restart=False), "15.18")
    assert "already ingested at revision 1; skipping" in capsys.readouterr().out
