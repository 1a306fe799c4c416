"""The index as derived data: saved with revision and checksum, trusted only when it matches the DB."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select

from app.db import open_database
from app.settings import Settings
from foundation.db import read_session
from retrieval.index import INDEX_FILE, META_FILE
from retrieval.models import Embedding
from retrieval.retriever import Retriever
from tests.retrieval.corpus import FixtureCorpus
from tests.retrieval.fakes import HashingEmbedder

DOCS = {"a": "Alpha pumps move water.\n\nAlpha valves stop water.",
        "b": "Beta gauges read pressure.\n\nBeta pipes carry steam.",
        "c": "Gamma filters clean oil."}


def _key(result) -> list[tuple[int, str]]:  # type: ignore[no-untyped-def]
    return [(h.chunk_id, float(h.score).hex()) for h in result.hits]


def _meta(retriever: Retriever) -> dict:  # type: ignore[type-arg]
    return json.loads((retriever.directory / META_FILE).read_text())


def test_index_is_saved_per_embedder_with_revision_and_checksum(
        corpus: FixtureCorpus, retriever: Retriever, index_dir: Path) -> None:
    rev = corpus.commit(DOCS)
    retriever.sync()
    meta = _meta(retriever)
    assert retriever.directory.parent == index_dir
    assert retriever.directory.name == retriever.embedder.embedder_id.split(":")[1]
    assert meta["revision"] == rev and meta["embedder_id"] == retriever.embedder.embedder_id
    assert meta["n_vectors"] == 5 and meta["index_sha256"].startswith("sha256:")


def test_new_revisions_are_appended_without_a_rebuild(
        corpus: FixtureCorpus, retriever: Retriever) -> None:
    corpus.commit(DOCS)
    retriever.sync()
    r2 = corpus.commit({"d": "Delta tanks hold fuel.\n\nDelta hoses leak.", "c": None})
    res = retriever.retrieve("delta hoses", 1)
    assert res.revision == r2 and res.hits[0].document_id == "d"
    stats = retriever.sync()
    assert stats["action"] == "current" and stats["n_vectors"] == 7
    assert _meta(retriever)["revision"] == r2


def test_restarted_retriever_appends_revisions_ingested_while_it_was_down(
        engine: Engine, corpus: FixtureCorpus, retriever: Retriever, index_dir: Path) -> None:
    corpus.commit(DOCS)
    retriever.sync()
    corpus.commit({"d": "Delta tanks hold fuel."})
    stats = Retriever(engine, HashingEmbedder(), index_dir).sync()
    assert stats["action"] == "appended" and stats["added"] == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "wrong_revision", "wrong_digest", "no_meta"])
def test_corrupt_or_stale_index_is_rebuilt_and_results_are_identical(
        engine: Engine, corpus: FixtureCorpus, retriever: Retriever, index_dir: Path,
        damage: str) -> None:
    corpus.commit(DOCS)
    corpus.commit({"d": "Delta tanks hold fuel."})
    expected = _key(retriever.retrieve("water pressure steam", 4))
    index_file, meta_file = retriever.directory / INDEX_FILE, retriever.directory / META_FILE
    data = bytearray(index_file.read_bytes())
    meta = json.loads(meta_file.read_text())
    if damage == "truncate":
        index_file.write_bytes(bytes(data[:-100]))
    elif damage == "flip":
        data[len(data) // 2] ^= 0x40
        index_file.write_bytes(bytes(data))
    elif damage == "wrong_revision":
        meta["revision"] = 1  # the file really reflects revision 2
        meta_file.write_text(json.dumps(meta))
    elif damage == "wrong_digest":
        meta["chunks_digest"] = "sha256:" + "0" * 64
        meta_file.write_text(json.dumps(meta))
    else:
        meta_file.unlink()
    fresh = Retriever(engine, HashingEmbedder(), index_dir)
    stats = fresh.sync()
    assert stats["action"] == "rebuilt" and stats["reason"]
    assert _key(fresh.retrieve("water pressure steam", 4)) == expected


def test_index_from_another_database_is_not_trusted(
        corpus: FixtureCorpus, retriever: Retriever, index_dir: Path, settings: Settings,
        tmp_path: Path) -> None:
    corpus.commit(DOCS)
    retriever.sync()
    other = open_database(settings.model_copy(update={
        "database_url": f"sqlite:///{tmp_path / 'other.db'}"}))
    try:
        FixtureCorpus(other, HashingEmbedder()).commit({"z": "Zeta is unrelated."})
        stats = Retriever(other, HashingEmbedder(), index_dir).sync()
        assert stats["action"] == "rebuilt" and stats["n_vectors"] == 1
    finally:
        other.dispose()


def test_two_embedders_never_share_an_index(
        engine: Engine, corpus: FixtureCorpus, retriever: Retriever, index_dir: Path) -> None:
    corpus.commit(DOCS)
    other_embedder = HashingEmbedder(salt="other")
    other = Retriever(engine, other_embedder, index_dir)
    stats = other.sync()
    assert other.directory != retriever.directory
    assert stats["action"] == "rebuilt" and stats["embedded"] == 5  # re-embedded lazily, own vectors
    retriever.sync()
    with read_session(engine) as s:
        per_embedder = dict(s.execute(select(Embedding.embedder_id, func.count())
                                      .group_by(Embedding.embedder_id)).all())
    assert per_embedder == {retriever.embedder.embedder_id: 5, other_embedder.embedder_id: 5}
    q = "alpha water"
    assert other.retrieve(q, 5).embedder_id != retriever.retrieve(q, 5).embedder_id


def test_chunks_ingested_without_vectors_are_embedded_lazily(
        engine: Engine, retriever: Retriever, fake_embedder: HashingEmbedder) -> None:
    FixtureCorpus(engine, embedder=None).commit(DOCS)
    stats = retriever.sync()
    assert stats["embedded"] == 5 and stats["n_vectors"] == 5
    assert retriever.retrieve("gamma oil", 1).hits[0].document_id == "c"


def test_reindex_rebuilds_from_the_database(corpus: FixtureCorpus, retriever: Retriever) -> None:
    corpus.commit(DOCS)
    before = _key(retriever.retrieve("beta steam", 3))
    stats = retriever.reindex()
    assert stats["action"] == "rebuilt" and stats["n_vectors"] == 5 and stats["embedded"] == 0
    assert _key(retriever.retrieve("beta steam", 3)) == before


def test_unwritable_index_directory_still_serves_from_memory(
        engine: Engine, corpus: FixtureCorpus, fake_embedder: HashingEmbedder, tmp_path: Path) -> None:
    corpus.commit(DOCS)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the index directory should be")
    retriever = Retriever(engine, fake_embedder, blocker)
    assert retriever.retrieve("gamma oil", 1).hits[0].document_id == "c"
