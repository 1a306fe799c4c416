"""Ingest-time embedding cache: compute_missing (read-only) and insert_embeddings."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import Engine, func, select

from foundation.db import WriterLock, read_session, write_transaction
from foundation.errors import InvalidInput
from retrieval.embedding import compute_missing, insert_embeddings, vector_from_bytes
from retrieval.models import EmbedderRecord, Embedding
from tests.retrieval.corpus import FixtureCorpus
from tests.retrieval.fakes import HashingEmbedder


def test_compute_missing_embeds_each_hash_once_in_hash_order(
        engine: Engine, fake_embedder: HashingEmbedder) -> None:
    pairs = [("sha256:b", "bee"), ("sha256:a", "ay"), ("sha256:b", "bee"), ("sha256:c", "sea")]
    seen: list[int] = []
    with read_session(engine) as s:
        out = compute_missing(s, fake_embedder, pairs, progress=seen.append, group_size=2)
    assert list(out) == ["sha256:a", "sha256:b", "sha256:c"]
    assert fake_embedder.calls == [2, 1] and seen == [2, 1]
    assert out["sha256:b"].dtype == np.float32 and out["sha256:b"].shape == (fake_embedder.dim,)


def test_compute_missing_skips_hashes_already_stored(engine: Engine, fake_embedder: HashingEmbedder) -> None:
    with write_transaction(engine, WriterLock.CORPUS) as s:
        insert_embeddings(s, fake_embedder, compute_missing(s, fake_embedder, [("sha256:a", "ay")]))
    with read_session(engine) as s:
        out = compute_missing(s, fake_embedder, [("sha256:a", "ay"), ("sha256:c", "sea")])
    assert list(out) == ["sha256:c"]


def test_insert_embeddings_stores_little_endian_float32_and_the_embedder_record(
        engine: Engine, fake_embedder: HashingEmbedder) -> None:
    vec = fake_embedder.embed_documents(["pump"])[0]
    with write_transaction(engine, WriterLock.CORPUS) as s:
        assert insert_embeddings(s, fake_embedder, {"sha256:p": vec}) == 1
    with write_transaction(engine, WriterLock.CORPUS) as s:
        assert insert_embeddings(s, fake_embedder, {"sha256:p": vec * 0}) == 0  # never overwritten
    with read_session(engine) as s:
        row = s.get(Embedding, ("sha256:p", fake_embedder.embedder_id))
        rec = s.get(EmbedderRecord, fake_embedder.embedder_id)
    assert row is not None and rec is not None
    assert row.vector == vec.astype("<f4").tobytes() and row.dim == fake_embedder.dim
    assert vector_from_bytes(row.vector, row.dim).tobytes() == vec.tobytes()
    assert '"model":"hashing-fake"' in rec.config_json


def test_insert_embeddings_rejects_a_vector_of_the_wrong_shape(
        engine: Engine, fake_embedder: HashingEmbedder) -> None:
    with pytest.raises(InvalidInput), write_transaction(engine, WriterLock.CORPUS) as s:
        insert_embeddings(s, fake_embedder, {"sha256:p": np.zeros(3, np.float32)})


def test_unchanged_chunk_text_in_a_new_version_is_not_embedded_again(
        engine: Engine, fake_embedder: HashingEmbedder) -> None:
    corpus = FixtureCorpus(engine, fake_embedder)
    corpus.commit({"doc": "Same first paragraph.\n\nOld second paragraph."})
    fake_embedder.calls.clear()
    corpus.commit({"doc": "Same first paragraph.\n\nNew second paragraph."})
    assert fake_embedder.calls == [1]
    with read_session(engine) as s:
        assert s.execute(select(func.count()).select_from(Embedding)).scalar_one() == 3
