"""The FAISS index: exact inner product over every chunk vector, persisted with a checksum.

Layout: ``IndexIDMap(IndexFlatIP)``. The index holds the vector of every chunk
ever ingested up to ``revision`` (the store is append-only), so one index
serves the live search and every pinned older revision: a search is restricted
to the chunks live at R by an ``IDSelectorBitmap`` over index positions.

Exactness and determinism: for a single query FAISS scores each stored vector
with one SIMD dot product (``fvec_inner_product``) whose result depends only on
the two vectors, not on the vector's position, the other vectors or the
selector (pinned by ``tests/retrieval/test_index.py``). Ties are broken here by
chunk id: FAISS is asked for more than k results until the k-th score is
strictly above the last score returned, then hits are sorted by
``(-score, chunk id)``, so top-k is always a prefix of top-K.

On disk (``<index_dir>/<embedder hex>/``): ``index.faiss`` and ``meta.json``
holding the revision and root hash it reflects, the embedder id, a digest of
the ``(chunk id, chunk hash)`` set and the file's ``sha256``. A file whose
checksum, embedder, dimension or size does not match is never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

INDEX_FORMAT = 1
INDEX_FILE = "index.faiss"
META_FILE = "meta.json"


def index_params() -> dict[str, Any]:
    """The parameters that define a search (part of every retrieval result)."""
    return {"type": "IndexIDMap(IndexFlatIP)", "metric": "inner_product", "exact": True,
            "tie_break": "chunk_id_ascending", "faiss": faiss.__version__,
            "simd": _simd_level(), "format": INDEX_FORMAT}


def _simd_level() -> str:
    try:
        return str(faiss.SIMDConfig.get_level_name())
    except Exception:  # older/newer faiss without SIMDConfig
        return "unknown"


@contextlib.contextmanager
def omp_threads(n: int | None) -> Iterator[None]:
    """Run FAISS with ``n`` OpenMP threads in this OS thread, restoring the previous setting.

    FAISS and torch share the OpenMP runtime in this process, so the previous
    value is always restored (the embedder re-applies its own count anyway).
    """
    if n is None:
        yield
        return
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


@dataclass(frozen=True)
class Selection:
    """The chunks a search may return: a bitmap over index positions.

    ``bitmap`` must stay referenced while FAISS uses it (the selector holds a raw pointer).
    """

    bitmap: np.ndarray  # uint8, little bit order, position i -> bit i
    n_selected: int

    def selector(self) -> Any:
        """A FAISS ``IDSelectorBitmap`` over :attr:`bitmap` (valid while the bitmap lives)."""
        return faiss.IDSelectorBitmap(len(self.bitmap), faiss.swig_ptr(self.bitmap))


@dataclass
class IndexMeta:
    """What an index file reflects; stored next to it as ``meta.json``."""

    format: int
    embedder_id: str
    dim: int
    revision: int
    root_hash: str | None
    n_vectors: int
    chunks_digest: str
    index_sha256: str
    faiss_version: str


class _Prefilter:
    """8-bit scalar-quantised copy of the vectors with a bound on its score error.

    For every stored vector x with reconstruction x', ``|q.x - q.x'| <= |q| * |x - x'|``
    (Cauchy-Schwarz); ``err_max`` is the largest ``|x - x'|`` (float64). Float32
    rounding of both dot products over 384 terms is below ``d * 2**-24 * |q| ~ 2.3e-5 |q|``
    (Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1), covered by
    :data:`ROUNDING_SLACK`.
    """

    ROUNDING_SLACK = 1e-4

    def __init__(self, vectors: np.ndarray) -> None:
        d = vectors.shape[1]
        self.index = faiss.IndexScalarQuantizer(d, faiss.ScalarQuantizer.QT_8bit,
                                                faiss.METRIC_INNER_PRODUCT)
        self.index.train(vectors)
        self.err_max = 0.0
        self.add(vectors)

    def add(self, vectors: np.ndarray) -> None:
        for i in range(0, len(vectors), 65_536):
            part = vectors[i:i + 65_536]
            recon = self.index.sa_decode(self.index.sa_encode(part))
            err = np.linalg.norm(part.astype(np.float64) - recon.astype(np.float64), axis=1)
            self.err_max = max(self.err_max, float(err.max()))
        self.index.add(vectors)

    def bound(self, query: np.ndarray) -> float:
        """Largest possible ``|approximate - exact|`` score for this query."""
        qn = float(np.linalg.norm(query.astype(np.float64)))
        return qn * (self.err_max + self.ROUNDING_SLACK)


class VectorIndex:
    """Exact inner-product index over chunk ids (positions map to ids via :attr:`ids`).

    Above :attr:`PREFILTER_MIN` selected chunks a search first takes candidates
    from an 8-bit copy (a quarter of the memory traffic), enough of them that
    the error bound proves every chunk outside them scores below the k-th
    best, then scores the candidates with the same exact float32 search as
    below the threshold. Results are identical either way (tested).
    """

    PREFILTER_MIN = 20_000

    def __init__(self, dim: int, index: Any | None = None) -> None:
        self.dim = dim
        if index is None:
            self._flat = faiss.IndexFlatIP(dim)  # keep the inner index referenced
            index = faiss.IndexIDMap(self._flat)
        self.index = index
        ids = faiss.vector_to_array(self.index.id_map) if self.index.ntotal else np.zeros(0)
        self.ids = np.asarray(ids, dtype=np.int64)
        self._prefilter: _Prefilter | None = None
        self._reindex_positions()

    def _reindex_positions(self) -> None:
        self._order = np.argsort(self.ids, kind="stable")
        self._sorted_ids = self.ids[self._order]

    @property
    def ntotal(self) -> int:
        """Number of vectors in the index."""
        return int(self.index.ntotal)

    def memory_bytes(self) -> int:
        """Bytes held: vectors ``4 * dim * n``, FAISS id map ``8n``, the id, order and sorted-id
        arrays kept here (``3 * 8n``) and the 8-bit prefilter codes (``dim * n``) once built."""
        pre = self.ntotal * self.dim if self._prefilter is not None else 0
        return (self.ntotal * (4 * self.dim + 8) + self.ids.nbytes + self._order.nbytes
                + self._sorted_ids.nbytes + pre)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Append ``(n,)`` int64 chunk ids with their ``(n, dim)`` float32 vectors.

        Raises:
            ValueError: shapes disagree or an id is already present.
        """
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.shape != (len(ids), self.dim):
            raise ValueError(f"vectors {vectors.shape} do not match ids ({len(ids)},) x {self.dim}")
        if len(ids) == 0:
            return
        if self.contains(ids).any() or len(np.unique(ids)) != len(ids):
            raise ValueError("duplicate chunk id in index add")
        self.index.add_with_ids(vectors, ids)
        self.ids = np.concatenate([self.ids, ids])
        self._reindex_positions()
        if self._prefilter is not None:
            self._prefilter.add(vectors)

    def warm(self) -> None:
        """Build the 8-bit candidate copy now if searches will use it (instead of on first use)."""
        if self.ntotal >= self.PREFILTER_MIN:
            self._get_prefilter()

    def _get_prefilter(self) -> _Prefilter:
        """The 8-bit candidate index, trained on the vectors present when first needed."""
        if self._prefilter is None:
            self._prefilter = _Prefilter(self.index.index.reconstruct_n(0, self.ntotal))
        return self._prefilter

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``ids`` are in the index."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.ntotal == 0:
            return np.zeros(len(ids), dtype=bool)
        pos = np.searchsorted(self._sorted_ids, ids)
        pos = np.minimum(pos, len(self._sorted_ids) - 1)
        return np.asarray(self._sorted_ids[pos] == ids)

    def select(self, ids: np.ndarray) -> Selection:
        """A :class:`Selection` of the given chunk ids.

        Raises:
            KeyError: an id is not in the index.
        """
        ids = np.asarray(ids, dtype=np.int64)
        mask = self.contains(ids)
        if not mask.all():
            raise KeyError(f"{int((~mask).sum())} chunk ids are not in the index")
        positions = self._order[np.searchsorted(self._sorted_ids, ids)]
        bits = np.zeros(self.ntotal, dtype=np.uint8)
        bits[positions] = 1
        return Selection(np.packbits(bits, bitorder="little"), int(len(np.unique(ids))))

    def search(self, query: np.ndarray, k: int, selection: Selection,
               threads: int | None = 1, margin: int = 8) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k among the selected chunks.

        Args:
            query: ``(dim,)`` float32.
            k: hits wanted; more than the selection returns all of it.
            threads: OpenMP threads for this call (None: leave as is).

        Returns:
            ``(scores (m,) float32, chunk ids (m,) int64)`` with ``m = min(k,
            n_selected)``, ordered by descending score then ascending chunk id.
            Never a -1 id or a sentinel score.
        """
        k = min(int(k), selection.n_selected)
        if k <= 0:
            return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int64)
        q = np.ascontiguousarray(query, dtype=np.float32).reshape(1, self.dim)
        with omp_threads(threads):
            if selection.n_selected >= self.PREFILTER_MIN:
                selection = self._candidates(q, k, selection) or selection
            d, p = _exact_top(self.index.index, q, k, selection, margin)
        ids = self.ids[p]
        order = np.lexsort((ids, -d))[:k]
        return d[order].astype(np.float32), ids[order]

    def _candidates(self, q: np.ndarray, k: int, selection: Selection) -> Selection | None:
        """Selected chunks that may be in the exact top-k (ties included); None: all of them.

        Takes the top m by approximate score a, doubling m until
        ``a_(k) - a_(m) > 2 * bound``: then at least k candidates score at least
        ``a_(k) - bound`` exactly, while every other chunk scores at most
        ``a_(m) + bound``, strictly less.
        """
        pre = self._get_prefilter()
        bound = pre.bound(q)
        n = selection.n_selected
        sel = selection.selector()  # keep referenced while FAISS holds its pointer
        params = faiss.SearchParameters(sel=sel)  # type: ignore[call-arg]
        m = max(64, 4 * k)
        while m < n:
            dist, pos = pre.index.search(q, m, params=params)
            d, p = dist[0], pos[0]
            if (p < 0).any():
                from foundation.errors import IntegrityFailure

                raise IntegrityFailure("prefilter returned fewer hits than selected chunks")
            if d[k - 1] - d[m - 1] > 2 * bound:
                bits = np.zeros(self.ntotal, dtype=np.uint8)
                bits[p] = 1
                return Selection(np.packbits(bits, bitorder="little"), m)
            m *= 2
        return None

    # --- persistence ------------------------------------------------------------------------

    def save(self, directory: Path, meta: IndexMeta) -> IndexMeta:
        """Write ``index.faiss`` then ``meta.json`` atomically; return the meta with the checksum."""
        directory.mkdir(parents=True, exist_ok=True)
        data = faiss.serialize_index(self.index).tobytes()
        meta.index_sha256 = "sha256:" + hashlib.sha256(data).hexdigest()
        meta.n_vectors = self.ntotal
        _atomic_write(directory / INDEX_FILE, data)
        _atomic_write(directory / META_FILE, json.dumps(asdict(meta), sort_keys=True).encode())
        return meta

    @classmethod
    def load(cls, directory: Path, embedder_id: str, dim: int) -> tuple[VectorIndex, IndexMeta]:
        """Load a saved index after checking its meta and checksum.

        Raises:
            IntegrityFailure: missing, unreadable, corrupt, or made for another
                embedder, dimension or format (the caller rebuilds).
        """
        from foundation.errors import IntegrityFailure

        try:
            raw = json.loads((directory / META_FILE).read_text())
            meta = IndexMeta(**raw)
            data = (directory / INDEX_FILE).read_bytes()
        except (OSError, ValueError, TypeError) as exc:
            raise IntegrityFailure(f"index files unreadable: {exc}") from exc
        if meta.format != INDEX_FORMAT or meta.embedder_id != embedder_id or meta.dim != dim:
            raise IntegrityFailure("index was built for another embedder, dimension or format")
        if "sha256:" + hashlib.sha256(data).hexdigest() != meta.index_sha256:
            raise IntegrityFailure("index file checksum does not match its meta")
        try:
            index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
        except RuntimeError as exc:
            raise IntegrityFailure(f"index file does not deserialise: {exc}") from exc
        if not isinstance(index, faiss.IndexIDMap) or index.ntotal != meta.n_vectors or index.d != dim:
            raise IntegrityFailure("index contents do not match its meta")
        return cls(dim, index), meta


def _exact_top(flat: Any, q: np.ndarray, k: int, selection: Selection,
               margin: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact float32 scores and positions of the top k selected vectors, every tie at the k-th
    score included (FAISS orders ties arbitrarily, so ask for more until the last is lower)."""
    n = selection.n_selected
    sel = selection.selector()  # keep referenced while FAISS holds its pointer
    params = faiss.SearchParameters(sel=sel)  # type: ignore[call-arg]
    kk = min(n, k + margin)
    while True:
        dist, pos = flat.search(q, kk, params=params)
        d, p = dist[0], pos[0]
        if (p < 0).any():
            from foundation.errors import IntegrityFailure

            raise IntegrityFailure("index returned fewer hits than selected chunks")
        # FAISS returns scores descending; the k-th value is order-independent.
        if kk >= n or d[kk - 1] < d[k - 1]:
            return d, p
        kk = min(n, kk * 2)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
