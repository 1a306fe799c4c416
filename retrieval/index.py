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


class VectorIndex:
    """Exact inner-product index over chunk ids (positions map to ids via :attr:`ids`)."""

    def __init__(self, dim: int, index: Any | None = None) -> None:
        self.dim = dim
        if index is None:
            self._flat = faiss.IndexFlatIP(dim)  # keep the inner index referenced
            index = faiss.IndexIDMap(self._flat)
        self.index = index
        ids = faiss.vector_to_array(self.index.id_map) if self.index.ntotal else np.zeros(0)
        self.ids = np.asarray(ids, dtype=np.int64)
        self._reindex_positions()

    def _reindex_positions(self) -> None:
        self._order = np.argsort(self.ids, kind="stable")
        self._sorted_ids = self.ids[self._order]

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def memory_bytes(self) -> int:
        """Bytes held: vectors ``4 * dim * n``, FAISS id map ``8n``, and the id, order and sorted-id
        arrays kept here (``3 * 8n``)."""
        return (self.ntotal * (4 * self.dim + 8) + self.ids.nbytes + self._order.nbytes
                + self._sorted_ids.nbytes)

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
        n = selection.n_selected
        k = min(int(k), n)
        if k <= 0:
            return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int64)
        q = np.ascontiguousarray(query, dtype=np.float32).reshape(1, self.dim)
        sel = selection.selector()
        params = faiss.SearchParameters(sel=sel)  # type: ignore[call-arg]
        kk = min(n, k + margin)
        with omp_threads(threads):
            while True:
                dist, pos = self.index.index.search(q, kk, params=params)
                d, p = dist[0], pos[0]
                if (p < 0).any():
                    from foundation.errors import IntegrityFailure

                    raise IntegrityFailure("index returned fewer hits than selected chunks")
                # FAISS returns scores descending; the k-th value is order-independent.
                if kk >= n or d[kk - 1] < d[k - 1]:
                    break
                kk = min(n, kk * 2)
        ids = self.ids[p]
        order = np.lexsort((ids, -d))[:k]
        return d[order].astype(np.float32), ids[order]

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


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
