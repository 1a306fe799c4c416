"""VectorIndex: exact per-vector scores, tie order, prefix property, bounds, persistence checks."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from foundation.errors import IntegrityFailure
from retrieval.index import INDEX_FILE, META_FILE, IndexMeta, VectorIndex

DIM = 32


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _index(vectors: np.ndarray, ids: np.ndarray) -> VectorIndex:
    idx = VectorIndex(DIM)
    idx.add(ids, vectors)
    return idx


def _meta() -> IndexMeta:
    return IndexMeta(format=1, embedder_id="sha256:e", dim=DIM, revision=3, root_hash="sha256:r",
                     n_vectors=0, chunks_digest="sha256:d", index_sha256="", faiss_version="x")


def test_score_of_a_vector_does_not_depend_on_position_or_neighbours() -> None:
    rng = np.random.default_rng(0)
    x, q = _unit(rng, 301), _unit(rng, 1)[0]
    ids = np.arange(301, dtype=np.int64) * 3 + 1
    a = _index(x, ids)
    perm = rng.permutation(301)
    b = _index(x[perm], ids[perm])
    sa, ia = a.search(q, 301, a.select(ids))
    subset = ids[rng.choice(301, 57, replace=False)]
    sb, ib = b.search(q, 301, b.select(subset))
    by_id = dict(zip(ia.tolist(), sa.tolist(), strict=True))
    assert all(by_id[i] == s for i, s in zip(ib.tolist(), sb.tolist(), strict=True))
    single = {int(i): faiss.fvec_inner_product(faiss.swig_ptr(q), faiss.swig_ptr(x[j]), DIM)
              for j, i in enumerate(ids)}
    assert all(np.float32(single[i]) == np.float32(s) for i, s in by_id.items())


def test_equal_scores_are_ordered_by_chunk_id_and_topk_is_a_prefix() -> None:
    rng = np.random.default_rng(1)
    v = _unit(rng, 2)
    x = np.stack([v[0]] * 20 + [v[1]] * 5)  # 20 exact ties
    ids = rng.permutation(np.arange(100, 125, dtype=np.int64))
    idx = _index(x, ids)
    sel = idx.select(ids)
    full_s, full_i = idx.search(v[0], 25, sel)
    tied = np.sort(ids[:20])
    assert full_i[:20].tolist() == tied.tolist()
    for k in range(1, 26):
        s, i = idx.search(v[0], k, sel, margin=1)
        assert i.tolist() == full_i[:k].tolist()
        assert s.tolist() == full_s[:k].tolist()


def test_k_beyond_the_selection_returns_all_without_sentinels() -> None:
    rng = np.random.default_rng(2)
    x = _unit(rng, 10)
    ids = np.arange(10, dtype=np.int64)
    idx = _index(x, ids)
    s, i = idx.search(x[0], 50, idx.select(ids[:4]))
    assert sorted(i.tolist()) == [0, 1, 2, 3]
    assert (i >= 0).all() and np.isfinite(s).all() and (np.abs(s) <= 1.0001).all()


def test_empty_selection_and_empty_index_return_nothing() -> None:
    idx = VectorIndex(DIM)
    s, i = idx.search(np.ones(DIM, np.float32), 5, idx.select(np.zeros(0, np.int64)))
    assert len(s) == 0 and len(i) == 0


def test_selecting_an_unknown_id_is_refused() -> None:
    idx = _index(_unit(np.random.default_rng(3), 3), np.array([1, 2, 3]))
    with pytest.raises(KeyError):
        idx.select(np.array([4]))


def test_adding_a_duplicate_id_is_refused() -> None:
    idx = _index(_unit(np.random.default_rng(3), 3), np.array([1, 2, 3]))
    with pytest.raises(ValueError):
        idx.add(np.array([3]), _unit(np.random.default_rng(4), 1))


def test_saved_index_loads_with_identical_scores(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    x, ids = _unit(rng, 40), np.arange(40, dtype=np.int64) + 7
    idx = _index(x, ids)
    meta = idx.save(tmp_path, _meta())
    loaded, lmeta = VectorIndex.load(tmp_path, "sha256:e", DIM)
    assert lmeta == meta and meta.index_sha256.startswith("sha256:")
    a = idx.search(x[3], 40, idx.select(ids))
    b = loaded.search(x[3], 40, loaded.select(ids))
    assert a[0].tobytes() == b[0].tobytes() and a[1].tolist() == b[1].tolist()


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing_meta", "garbage_meta"])
def test_damaged_index_files_are_never_loaded(tmp_path: Path, damage: str) -> None:
    idx = _index(_unit(np.random.default_rng(6), 20), np.arange(20, dtype=np.int64))
    idx.save(tmp_path, _meta())
    path = tmp_path / INDEX_FILE
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "flip":
        data[len(data) - 7] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "missing_meta":
        (tmp_path / META_FILE).unlink()
    else:
        (tmp_path / META_FILE).write_text("{not json")
    with pytest.raises(IntegrityFailure):
        VectorIndex.load(tmp_path, "sha256:e", DIM)


def test_index_of_another_embedder_is_not_loaded(tmp_path: Path) -> None:
    _index(_unit(np.random.default_rng(7), 5), np.arange(5, dtype=np.int64)).save(tmp_path, _meta())
    with pytest.raises(IntegrityFailure):
        VectorIndex.load(tmp_path, "sha256:other", DIM)


def _clustered(rng: np.random.Generator, n: int) -> np.ndarray:
    """Unit vectors in tight clusters, with exact duplicates: many near and exact ties."""
    centres = _unit(rng, 12)
    x = centres[rng.integers(0, 12, n)] + 0.02 * rng.standard_normal((n, DIM)).astype(np.float32)
    x[::7] = x[3]  # exact duplicates
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_prefiltered_search_returns_exactly_the_plain_exact_result() -> None:
    rng = np.random.default_rng(8)
    x = _clustered(rng, 3000)
    ids = rng.permutation(np.arange(10_000, 13_000, dtype=np.int64))
    plain, pre = _index(x[:2500], ids[:2500]), _index(x[:2500], ids[:2500])
    pre.PREFILTER_MIN = 0
    pre.search(x[0], 1, pre.select(ids[:2500]))  # trains the 8-bit copy on the first 2500
    late = x[2500:] * np.where(np.arange(DIM) % 5 == 0, 3.0, 1.0).astype(np.float32)  # out of range
    late /= np.linalg.norm(late, axis=1, keepdims=True)
    for idx in (plain, pre):
        idx.add(ids[2500:], late)
    assert pre._prefilter is not None and pre._prefilter.err_max > 0
    subset = ids[rng.random(3000) < 0.8]
    queries = [x[3], x[10], late[0], _unit(rng, 1)[0]]
    for q in queries:
        for sel_ids in (ids, subset):
            for k in (1, 5, 37, 200):
                a = plain.search(q, k, plain.select(sel_ids))
                b = pre.search(q, k, pre.select(sel_ids))
                assert a[1].tolist() == b[1].tolist() and a[0].tobytes() == b[0].tobytes()


def test_prefilter_candidate_set_is_smaller_than_the_selection() -> None:
    rng = np.random.default_rng(9)
    x, ids = _unit(rng, 5000), np.arange(5000, dtype=np.int64)
    idx = _index(x, ids)
    idx.PREFILTER_MIN = 0
    cand = idx._candidates(x[:1], 8, idx.select(ids))
    assert cand is not None and 8 <= cand.n_selected < 5000
