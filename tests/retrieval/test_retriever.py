"""The retriever contract, on SQLite and PostgreSQL, with a fake embedder and ORM-written fixtures."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import Engine

from foundation.errors import InvalidInput, UnknownRevision
from retrieval.retriever import Retriever
from tests.conftest import CASES
from tests.retrieval.corpus import FixtureCorpus
from tests.retrieval.fakes import HashingEmbedder

V1 = (CASES / "doc_v1.txt").read_text(encoding="utf-8")
V2 = (CASES / "doc_v2_shorter_changed.txt").read_text(encoding="utf-8")
TIES = json.loads((CASES / "faiss_tie_corpus.json").read_text(encoding="utf-8"))
OTHER = {"pump": "The circulation pump is painted red.\n\nIts motor draws 3 kW at full load.",
         "gauge": "Gauge G1 measures loop pressure in bar.\n\nReplace the gauge every five years."}


def _key(result) -> list[tuple[int, str]]:  # type: ignore[no-untyped-def]
    return [(h.chunk_id, float(h.score).hex()) for h in result.hits]


def test_hits_carry_rank_score_ids_version_hash_offsets_and_text(
        corpus: FixtureCorpus, retriever: Retriever) -> None:
    rev = corpus.commit({"manual": V1, **OTHER})
    res = retriever.retrieve("gauge pressure", 3)
    assert res.revision == rev and res.root_hash and res.root_hash.startswith("sha256:")
    assert [h.rank for h in res.hits] == [1, 2, 3]
    top = res.hits[0]
    assert top.document_id == "gauge" and top.version == 1
    assert top.text == OTHER["gauge"][top.start_char:top.end_char]
    assert top.chunk_hash.startswith("sha256:") and top.n_tokens > 0
    assert all(float(np.float32(h.score)) == h.score for h in res.hits)
    assert res.embedder_id == retriever.embedder.embedder_id and res.embedder["dim"] == 64
    assert res.index["metric"] == "inner_product" and res.index["exact"] is True
    assert set(res.timings_ms) == {"embed", "search", "fetch", "total"}


def test_scores_are_the_exact_float32_inner_products(
        corpus: FixtureCorpus, retriever: Retriever, fake_embedder: HashingEmbedder) -> None:
    corpus.commit(OTHER)
    res = retriever.retrieve("red pump motor", 4)
    q = fake_embedder.embed_query("red pump motor")[0]
    for h in res.hits:
        v = fake_embedder.embed_documents([h.text])[0]
        assert abs(h.score - float(np.dot(q.astype(np.float64), v))) < 1e-6


def test_same_query_same_revision_gives_identical_results_across_calls(
        corpus: FixtureCorpus, retriever: Retriever) -> None:
    corpus.commit({"manual": V1, **OTHER})
    first = retriever.retrieve("coolant level hoses", 8)
    assert all(_key(retriever.retrieve("coolant level hoses", 8)) == _key(first) for _ in range(3))


def test_restart_and_rebuild_give_identical_results(
        engine: Engine, corpus: FixtureCorpus, retriever: Retriever, index_dir: Path) -> None:
    corpus.commit({"manual": V1, **OTHER})
    first = retriever.retrieve("flange bolts torque", 6)
    restarted = Retriever(engine, HashingEmbedder(), index_dir)
    assert restarted.sync()["action"] == "current"  # loaded from disk, no rebuild
    assert _key(restarted.retrieve("flange bolts torque", 6)) == _key(first)
    assert restarted.reindex()["action"] == "rebuilt"
    assert _key(restarted.retrieve("flange bolts torque", 6)) == _key(first)


def test_pinned_revision_is_unchanged_after_later_ingests(
        corpus: FixtureCorpus, retriever: Retriever) -> None:
    r1 = corpus.commit({"manual": V1, **OTHER})
    before = retriever.retrieve("gauge reading logbook", 10, revision=r1)
    corpus.commit({"manual": V2, "new": "Gauge readings go in the logbook.\n\nLogbook gauge gauge."})
    corpus.commit({"pump": None})
    after = retriever.retrieve("gauge reading logbook", 10, revision=r1)
    assert _key(after) == _key(before) and after.root_hash == before.root_hash


def test_ties_are_ordered_by_chunk_id_and_topk_is_a_prefix(
        corpus: FixtureCorpus, retriever: Retriever) -> None:
    corpus.commit({d["id"]: d["text"] for d in TIES["docs"]})
    full = retriever.retrieve(TIES["query"], max(TIES["ks"]))
    scores = [h.score for h in full.hits]
    tied = [h for h in full.hits if h.document_id in {"d1", "d2", "d3"}]
    assert len({h.score for h in tied}) == 1
    assert [h.chunk_id for h in tied] == sorted(h.chunk_id for h in tied)
    assert scores == sorted(scores, reverse=True)
    for k in TIES["ks"]:
        assert _key(retriever.retrieve(TIES["query"], k)) == _key(full)[:k]


def test_k_beyond_live_chunks_returns_all_and_no_sentinels(
        corpus: FixtureCorpus, retriever: Retriever) -> None:
    corpus.commit({d["id"]: d["text"] for d in TIES["docs"]})
    res = retriever.retrieve(TIES["query"], 10)
    assert len(res.hits) == 5
    assert all(h.chunk_id >= 0 and -1.0001 <= h.score <= 1.0001 for h in res.hits)


def test_empty_corpus_returns_no_hits(retriever: Retriever) -> None:
    res = retriever.retrieve("anything at all", 5)
    assert res.hits == [] and res.revision == 0


def test_corpus_whose_documents_were_all_deleted_returns_no_hits(
        corpus: FixtureCorpus, retriever: Retriever) -> None:
    corpus.commit(OTHER)
    corpus.commit({"pump": None, "gauge": None})
    assert retriever.retrieve("pump", 5).hits == []
    assert len(retriever.retrieve("pump", 5, revision=1).hits) == 4


@pytest.mark.parametrize("query", ["", "   ", "\n\t ", "\u200b\u2060"])
def test_empty_or_whitespace_query_is_invalid_input(retriever: Retriever, query: str) -> None:
    with pytest.raises(InvalidInput) as err:
        retriever.retrieve(query, 3)
    assert err.value.code == "empty_query"


@pytest.mark.parametrize("k", [0, -1])
def test_non_positive_k_is_invalid_input(retriever: Retriever, k: int) -> None:
    with pytest.raises(InvalidInput):
        retriever.retrieve("pump", k)


def test_long_query_is_truncated_identically_and_flagged(
        corpus: FixtureCorpus, retriever: Retriever) -> None:
    corpus.commit(OTHER)
    long_query = " ".join(["pump"] * 10 + [f"word{i}" for i in range(200)])
    a = retriever.retrieve(long_query, 4)
    b = retriever.retrieve(long_query + " gauge gauge gauge", 4)  # beyond the limit: same cut
    assert a.query_truncated and a.query_wordpieces == 212
    assert _key(a) == _key(b)
    assert not retriever.retrieve("pump", 4).query_truncated


def test_updated_document_is_live_only_in_its_new_version(
        corpus: FixtureCorpus, retriever: Retriever) -> None:
    r1 = corpus.commit({"manual": V1})
    r2 = corpus.commit({"manual": V2})
    live = retriever.retrieve("cooling loop unit serviced coolant", 50)
    assert live.revision == r2 and {h.version for h in live.hits} == {2}
    assert all(h.text == V2.replace("\r\n", "\n")[h.start_char:h.end_char] for h in live.hits)
    pinned = retriever.retrieve("cooling loop unit serviced coolant", 50, revision=r1)
    assert {h.version for h in pinned.hits} == {1}
    assert len(pinned.hits) > len(live.hits)


@pytest.mark.parametrize("revision", [-1, 99])
def test_unknown_revision_is_not_found(corpus: FixtureCorpus, retriever: Retriever, revision: int) -> None:
    corpus.commit(OTHER)
    with pytest.raises(UnknownRevision):
        retriever.retrieve("pump", 3, revision=revision)


def test_concurrent_retrieves_agree_with_a_serial_one(
        corpus: FixtureCorpus, retriever: Retriever) -> None:
    corpus.commit({"manual": V1, **OTHER})
    expected = {q: _key(retriever.retrieve(q, 5)) for q in ("pump", "gauge bar", "flange bolts")}
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(10):
                for q, key in expected.items():
                    assert _key(retriever.retrieve(q, 5)) == key
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_retrieve_vector_matches_retrieve(
        corpus: FixtureCorpus, retriever: Retriever, fake_embedder: HashingEmbedder) -> None:
    corpus.commit(OTHER)
    vec = fake_embedder.embed_query("gauge bar")[0]
    assert _key(retriever.retrieve_vector(vec, 3)) == _key(retriever.retrieve("gauge bar", 3))


def test_to_dict_can_leave_out_chunk_text(corpus: FixtureCorpus, retriever: Retriever) -> None:
    corpus.commit(OTHER)
    res = retriever.retrieve("pump", 2)
    assert "text" in res.to_dict()["hits"][0]
    assert "text" not in res.to_dict(include_text=False)["hits"][0]
    json.dumps(res.to_dict())


def test_results_are_identical_with_the_8bit_prefilter(
        engine: Engine, corpus: FixtureCorpus, retriever: Retriever, index_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    r1 = corpus.commit({d["id"]: d["text"] for d in TIES["docs"]} | {"manual": V1})
    corpus.commit({"manual": V2})
    cases = [(TIES["query"], k, rev) for k in (1, 3, 10) for rev in (None, r1)]
    cases += [("gauge reading logbook", 20, rev) for rev in (None, r1)]
    expected = [_key(retriever.retrieve(q, k, rev)) for q, k, rev in cases]
    from retrieval.index import VectorIndex

    monkeypatch.setattr(VectorIndex, "PREFILTER_MIN", 1)
    prefiltered = Retriever(engine, HashingEmbedder(), index_dir)
    assert [_key(prefiltered.retrieve(q, k, rev)) for q, k, rev in cases] == expected
    assert prefiltered._index is not None and prefiltered._index._prefilter is not None
