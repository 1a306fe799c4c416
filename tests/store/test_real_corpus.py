"""The real corpus: PostgreSQL 15.18 docs, then 15.20 (only the visible-text changes count)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.db import open_database
from app.ingest import collect_files
from app.settings import get_settings
from foundation.db import read_session
from retrieval.chunking import ChunkerConfig
from retrieval.corpus import deb_name, fetch_postgres_docs
from retrieval.store import get_version, ingest_batch, verify_store
from tests.conftest import CORPORA

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not all((CORPORA / deb_name(v)).is_file() for v in ("15.18", "15.20")):
        pytest.skip("corpus .deb files not present")
    data = tmp_path_factory.mktemp("corpus")
    return {v: Path(fetch_postgres_docs(data, v, search_dirs=[CORPORA]).path) for v in ("15.18", "15.20")}


def test_15_18_then_15_20_adds_two_release_notes_and_updates_only_changed_pages(
        pages, tmp_path, tokenizer, embed_count):
    engine = open_database(get_settings(data_dir=tmp_path))
    config = ChunkerConfig(128, 16)

    def ingest(version: str):  # type: ignore[no-untyped-def]
        items, rejected = collect_files([pages[version]], 20 * 2**20)
        assert rejected == []
        return ingest_batch(engine, items, tokenizer=tokenizer, chunker_config=config,
                            embed_token_count=embed_count)

    first = ingest("15.18")
    assert (first.revision, first.counts["added"], first.counts["rejected"]) == (1, 1167, 0)
    second = ingest("15.20")
    added = sorted(r.document_id for r in second.results if r.status == "added")
    assert second.revision == 2 and added == ["release-15-19.html", "release-15-20.html"]
    assert 80 <= second.counts["updated"] <= 100
    assert second.counts["unchanged"] == 1167 - second.counts["updated"]
    assert second.counts["deleted"] == second.counts["rejected"] == 0
    third = ingest("15.20")
    assert third.revision is None and third.counts["unchanged"] == 1169
    with read_session(engine) as s:
        v = get_version(s, "sql-select.html", 1)
        assert "PostgreSQL 15.18" not in v.text and v.text.startswith("SELECT")
        assert v.source["sha256"] == v.source_hash and v.source_hash != v.content_hash
        assert verify_store(s) == []
    engine.dispose()
