"""Version-pinned, deterministic retrieval: ``retrieve(query, k, revision)``.

Retrieval at revision R is a pure function of (query, R, embedder id, index
parameters): the query is embedded alone (batch size 1), scored exactly
against the stored vectors of the chunks live at R, and ranked by
``(-score, chunk id)``. Scores are returned as the exact float32 values.

The FAISS index (:mod:`retrieval.index`) is derived data. On first use it is
loaded from ``<index_dir>/<embedder hex>/`` only if its checksum, embedder,
revision, root hash and ``(chunk id, chunk hash)`` digest match the database;
otherwise it is rebuilt. When the database has moved on, the chunks of the new
revisions are appended (embedding any chunk text that has no vector yet for
this embedder) and the file is saved again. The index holds every chunk ever
ingested, so a search pinned to an older revision needs no other structure.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import unicodedata
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from sqlalchemy import Engine, bindparam, or_, select

from foundation.db import WriterLock, read_session, write_transaction
from foundation.errors import IntegrityFailure, InvalidInput, UnknownRevision
from foundation.hashing import normalize_text
from retrieval.embedding import Embedder, compute_missing, insert_embeddings
from retrieval.index import INDEX_FORMAT, IndexMeta, Selection, VectorIndex, index_params
from retrieval.models import Chunk, DocumentVersion, Embedding, Revision

log = logging.getLogger("ragbudget.retrieval")

_FETCH = (
    select(Chunk.id, Chunk.chunk_hash, Chunk.start_char, Chunk.end_char, Chunk.n_tokens, Chunk.text,
           DocumentVersion.document_id, DocumentVersion.version)
    .join(DocumentVersion, Chunk.version_id == DocumentVersion.id)
    .where(Chunk.id.in_(bindparam("ids", expanding=True)))
)


@dataclass(frozen=True)
class Hit:
    """One ranked chunk. ``score`` is the exact float32 inner product, as a Python float."""

    rank: int
    score: float
    chunk_id: int
    document_id: str
    version: int
    chunk_hash: str
    start_char: int
    end_char: int
    n_tokens: int
    text: str


@dataclass
class RetrievalResult:
    """Everything that determines (and describes) one retrieval."""

    revision: int
    root_hash: str | None
    embedder_id: str
    embedder: dict[str, Any]
    index: dict[str, Any]
    k: int
    query_truncated: bool
    query_wordpieces: int
    hits: list[Hit] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self, include_text: bool = True) -> dict[str, Any]:
        """JSON-ready dict; ``include_text=False`` drops each hit's ``text``.

        Each hit's ``chunk_id`` is a decimal string: ids are 63-bit, beyond the
        2**53 a JavaScript (or any double-based) JSON reader holds exactly.
        """
        out = asdict(self)
        for hit in out["hits"]:
            hit["chunk_id"] = str(hit["chunk_id"])
            if not include_text:
                hit.pop("text", None)
        return out


class RetrieverProtocol(Protocol):
    """What the answer pipeline, replay and the API need from a retriever (:class:`Retriever`)."""

    def retrieve(self, query: str, k: int, revision: int | None = None) -> RetrievalResult:
        """Top-``k`` chunks for ``query`` live at ``revision`` (default: latest), ranked by
        ``(-score, chunk id)``.

        Raises:
            InvalidInput: empty query or ``k < 1``.
            UnknownRevision: ``revision`` is not a committed revision.
        """
        ...

    def reindex(self) -> dict[str, Any]:
        """Rebuild the index from the database; return what was done."""
        ...


def is_blank_query(query: str) -> bool:
    """True when ``query`` holds nothing but whitespace and invisible format characters."""
    return all(c.isspace() or unicodedata.category(c) in {"Cf", "Cc"} for c in query)


class Retriever:
    """Exact top-k over the chunks live at a revision, for one embedder. Thread-safe.

    Args:
        engine: the store's database.
        embedder: a :class:`retrieval.embedding.Embedder`.
        index_dir: parent directory; this embedder's index lives in a subdirectory
            named after its id, so two embedders never share an index.
        search_threads: OpenMP threads for a FAISS search (1 is fastest for a
            single query on a busy 2-core machine; scores do not depend on it).
        live_cache_size: revisions whose live-chunk selection is kept in memory.
    """

    def __init__(self, engine: Engine, embedder: Embedder, index_dir: Path,
                 search_threads: int | None = 1, live_cache_size: int = 8) -> None:
        self.engine = engine
        self.embedder = embedder
        self.directory = Path(index_dir) / embedder.embedder_id.split(":", 1)[-1]
        self.search_threads = search_threads
        self.params = {**index_params(), "dim": embedder.dim}
        self._lock = threading.RLock()
        self._index: VectorIndex | None = None
        self._meta: IndexMeta | None = None
        self._live: OrderedDict[int, Selection] = OrderedDict()
        self._live_cache_size = live_cache_size

    # --- public API ---------------------------------------------------------------------------

    def retrieve(self, query: str, k: int, revision: int | None = None) -> RetrievalResult:
        """Top-``k`` chunks for ``query`` among those live at ``revision`` (default: latest).

        The query is normalised as stored text is (``foundation.hashing.normalize_text``:
        zero-width characters and soft hyphens removed, no-break spaces to spaces, NFC)
        before it is embedded.

        Raises:
            InvalidInput: (code ``empty_query``) the query is empty or whitespace;
                (code ``invalid_k``) ``k < 1``.
            UnknownRevision: ``revision`` is negative or not a committed revision.
        """
        if not isinstance(query, str) or is_blank_query(query):
            raise InvalidInput("the query is empty or whitespace only", code="empty_query")
        _check_k(k)
        t0 = time.perf_counter()
        vec, truncated, n_wp = self.embedder.embed_query(normalize_text(query))
        embed_ms = (time.perf_counter() - t0) * 1000
        return self._run(vec, k, revision, t0, embed_ms, truncated, n_wp)

    def retrieve_vector(self, vector: np.ndarray, k: int, revision: int | None = None) -> RetrievalResult:
        """Like :meth:`retrieve` for an already embedded ``(dim,)`` float32 query."""
        _check_k(k)
        vec = np.ascontiguousarray(vector, dtype=np.float32).reshape(self.embedder.dim)
        return self._run(vec, k, revision, time.perf_counter(), 0.0, False, 0)

    def sync(self) -> dict[str, Any]:
        """Bring the index up to the latest revision (load, append or rebuild); return what was done."""
        with self._lock:
            latest, _ = self._resolve(None)
            return self._ensure(latest)

    def reindex(self) -> dict[str, Any]:
        """Rebuild the index from the database (embedding missing vectors) and save it."""
        with self._lock:
            latest, _ = self._resolve(None)
            return self._build(latest, reason="reindex requested")

    # --- search -------------------------------------------------------------------------------

    def _run(self, vec: np.ndarray, k: int, revision: int | None, t0: float, embed_ms: float,
             truncated: bool, n_wp: int) -> RetrievalResult:
        rev, root = self._resolve(revision)
        t1 = time.perf_counter()
        with self._lock:
            if self._meta is None or self._meta.revision < rev or (
                    revision is None and self._meta.revision > rev):
                self._ensure(rev)
                t1 = time.perf_counter()
            index = self._index
            assert index is not None
            scores, ids = index.search(vec, k, self._selection(rev), threads=self.search_threads)
        t2 = time.perf_counter()
        hits = self._fetch(scores, ids)
        t3 = time.perf_counter()
        return RetrievalResult(
            revision=rev, root_hash=root, embedder_id=self.embedder.embedder_id,
            embedder=dict(self.embedder.identity), index=dict(self.params), k=int(k),
            query_truncated=bool(truncated), query_wordpieces=int(n_wp), hits=hits,
            timings_ms={"embed": embed_ms, "search": (t2 - t1) * 1000,
                        "fetch": (t3 - t2) * 1000, "total": (t3 - t0) * 1000})

    def _selection(self, rev: int) -> Selection:
        sel = self._live.get(rev)
        if sel is not None:
            self._live.move_to_end(rev)
            return sel
        assert self._index is not None
        ids = live_chunk_ids(self.engine, rev)
        try:
            sel = self._index.select(ids)
        except KeyError:  # a chunk live at rev is missing: the index cannot be trusted
            self._build(max(rev, self._meta.revision if self._meta else rev),
                        reason="live chunk missing from index")
            try:
                sel = self._index.select(ids)
            except KeyError as exc:
                raise IntegrityFailure(f"index does not cover revision {rev}: {exc}") from exc
        self._live[rev] = sel
        while len(self._live) > self._live_cache_size:
            self._live.popitem(last=False)
        return sel

    def _fetch(self, scores: np.ndarray, ids: np.ndarray) -> list[Hit]:
        if len(ids) == 0:
            return []
        with self.engine.connect() as conn:
            rows = {r.id: r for r in conn.execute(_FETCH, {"ids": [int(i) for i in ids]})}
        hits = []
        for rank, (score, cid) in enumerate(zip(scores.tolist(), ids.tolist(), strict=True), 1):
            r = rows.get(cid)
            if r is None:
                raise IntegrityFailure(f"chunk {cid} is in the index but not in the database")
            hits.append(Hit(rank=rank, score=float(score), chunk_id=int(cid),
                            document_id=r.document_id, version=int(r.version),
                            chunk_hash=r.chunk_hash, start_char=int(r.start_char),
                            end_char=int(r.end_char), n_tokens=int(r.n_tokens), text=r.text))
        return hits

    def _resolve(self, revision: int | None) -> tuple[int, str | None]:
        """``(revision, root hash)``; revision 0 is the empty corpus before the first ingest."""
        if revision is not None and (isinstance(revision, bool) or int(revision) < 0):
            raise UnknownRevision(f"unknown corpus revision {revision}", revision=revision)
        with self.engine.connect() as conn:
            if revision is None:
                row = conn.execute(select(Revision.number, Revision.root_hash)
                                   .order_by(Revision.number.desc()).limit(1)).first()
            elif int(revision) == 0:
                return 0, None
            else:
                row = conn.execute(select(Revision.number, Revision.root_hash)
                                   .where(Revision.number == int(revision))).first()
        if row is None:
            if revision is None:
                return 0, None
            raise UnknownRevision(f"unknown corpus revision {revision}", revision=int(revision))
        return int(row.number), row.root_hash

    # --- index maintenance (caller holds the lock) ---------------------------------------------

    def _ensure(self, target: int) -> dict[str, Any]:
        stats = self._ensure_revision(target)
        assert self._index is not None
        self._index.warm()
        return stats

    def _ensure_revision(self, target: int) -> dict[str, Any]:
        if self._index is None:
            reason = self._try_load(target)
            if reason is not None:
                return self._build(target, reason=reason)
        assert self._meta is not None
        if self._meta.revision > target:
            return self._build(target, reason="index is ahead of the database")
        if self._meta.revision < target:
            return self._append(target)
        return self._stats("current")

    def _try_load(self, latest: int) -> str | None:
        """Load the saved index if it matches the database; else return why not."""
        try:
            index, meta = VectorIndex.load(self.directory, self.embedder.embedder_id, self.embedder.dim)
        except IntegrityFailure as exc:
            return exc.message
        if meta.revision > latest:
            return "index is ahead of the database"
        try:
            root = self._resolve(meta.revision)[1]
        except UnknownRevision:
            return "index revision is unknown to the database"
        if root != meta.root_hash:
            return "index root hash does not match the database"
        ids, digest = chunk_digest(self.engine, 0, meta.revision)
        if digest != meta.chunks_digest or not np.array_equal(np.sort(index.ids), ids):
            return "index chunks do not match the database"
        self._index, self._meta = index, meta
        self._live.clear()
        return None

    def _build(self, target: int, reason: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        embedded = self._embed_missing(0, target)
        ids, vectors = load_vectors(self.engine, self.embedder.embedder_id, self.embedder.dim, 0, target)
        index = VectorIndex(self.embedder.dim)
        index.add(ids, vectors)
        self._index = index
        self._live.clear()
        self._save(target)
        index.warm()
        return self._stats("rebuilt", reason=reason, embedded=embedded, added=len(ids),
                           seconds=time.perf_counter() - t0)

    def _append(self, target: int) -> dict[str, Any]:
        assert self._meta is not None and self._index is not None
        t0 = time.perf_counter()
        start = self._meta.revision
        embedded = self._embed_missing(start, target)
        ids, vectors = load_vectors(self.engine, self.embedder.embedder_id, self.embedder.dim,
                                    start, target)
        self._index.add(ids, vectors)
        self._save(target)
        return self._stats("appended", embedded=embedded, added=len(ids),
                           seconds=time.perf_counter() - t0)

    def _save(self, target: int) -> None:
        assert self._index is not None
        _, digest = chunk_digest(self.engine, 0, target)
        meta = IndexMeta(format=INDEX_FORMAT, embedder_id=self.embedder.embedder_id,
                         dim=self.embedder.dim, revision=target, root_hash=self._resolve(target)[1],
                         n_vectors=self._index.ntotal, chunks_digest=digest, index_sha256="",
                         faiss_version=str(self.params["faiss"]))
        try:
            self._meta = self._index.save(self.directory, meta)
        except OSError as exc:  # derived data: serve from memory, rebuild at the next start
            log.warning("could not save the index to %s: %s", self.directory, exc)
            self._meta = meta

    def _embed_missing(self, after: int, upto: int) -> int:
        """Embed chunk texts of versions live from ``(after, upto]`` that lack a vector."""
        eid = self.embedder.embedder_id
        stmt = (select(Chunk.chunk_hash, Chunk.text)
                .join(DocumentVersion, Chunk.version_id == DocumentVersion.id)
                .outerjoin(Embedding, (Embedding.chunk_hash == Chunk.chunk_hash)
                           & (Embedding.embedder_id == eid))
                .where(DocumentVersion.live_from_revision > after,
                       DocumentVersion.live_from_revision <= upto, Embedding.chunk_hash.is_(None)))
        with read_session(self.engine) as session:
            pairs = [(h, t) for h, t in session.execute(stmt)]
            if not pairs:
                return 0
            vectors = compute_missing(session, self.embedder, pairs)
        with write_transaction(self.engine, WriterLock.CORPUS) as session:
            return insert_embeddings(session, self.embedder, vectors)

    def _stats(self, action: str, **extra: Any) -> dict[str, Any]:
        assert self._meta is not None and self._index is not None
        return {"action": action, "embedder_id": self.embedder.embedder_id,
                "revision": self._meta.revision, "n_vectors": self._index.ntotal,
                "index_sha256": self._meta.index_sha256, "path": str(self.directory),
                "memory_bytes": self._index.memory_bytes(), **extra}


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise InvalidInput(f"k must be a positive integer, got {k!r}", code="invalid_k")


def live_chunk_ids(engine: Engine, revision: int) -> np.ndarray:
    """``(n,)`` int64 ids of the chunks live at ``revision``, ascending (one SQL query)."""
    stmt = (select(Chunk.id).join(DocumentVersion, Chunk.version_id == DocumentVersion.id)
            .where(DocumentVersion.live_from_revision <= revision,
                   or_(DocumentVersion.live_until_revision.is_(None),
                       DocumentVersion.live_until_revision > revision),
                   DocumentVersion.is_tombstone.is_(False))
            .order_by(Chunk.id))
    with engine.connect() as conn:
        return np.fromiter((r[0] for r in conn.execute(stmt)), dtype=np.int64)


def chunk_digest(engine: Engine, after: int, upto: int) -> tuple[np.ndarray, str]:
    """Ids (ascending) and ``sha256:`` digest of ``(id, chunk hash)`` for versions live from (after, upto]."""
    stmt = (select(Chunk.id, Chunk.chunk_hash).join(DocumentVersion, Chunk.version_id == DocumentVersion.id)
            .where(DocumentVersion.live_from_revision > after,
                   DocumentVersion.live_from_revision <= upto)
            .order_by(Chunk.id))
    h = hashlib.sha256()
    ids = []
    with engine.connect() as conn:
        for cid, chash in conn.execute(stmt):
            ids.append(cid)
            h.update(f"{cid} {chash}\n".encode())
    return np.asarray(ids, dtype=np.int64), "sha256:" + h.hexdigest()


def load_vectors(engine: Engine, embedder_id: str, dim: int, after: int,
                 upto: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids (n,) int64, vectors (n, dim) float32)`` of chunks of versions live from (after, upto].

    Raises:
        IntegrityFailure: a chunk has no stored vector for ``embedder_id`` or a vector has the
            wrong length.
    """
    stmt = (select(Chunk.id, Embedding.vector)
            .join(DocumentVersion, Chunk.version_id == DocumentVersion.id)
            .outerjoin(Embedding, (Embedding.chunk_hash == Chunk.chunk_hash)
                       & (Embedding.embedder_id == embedder_id))
            .where(DocumentVersion.live_from_revision > after,
                   DocumentVersion.live_from_revision <= upto)
            .order_by(Chunk.id))
    ids: list[int] = []
    blobs: list[bytes] = []
    with engine.connect() as conn:
        for cid, vec in conn.execute(stmt):
            if vec is None or len(vec) != 4 * dim:
                raise IntegrityFailure(f"chunk {cid} has no valid vector for embedder {embedder_id}")
            ids.append(cid)
            blobs.append(bytes(vec))
    vectors = np.frombuffer(b"".join(blobs), dtype="<f4").astype(np.float32).reshape(len(ids), dim)
    return np.asarray(ids, dtype=np.int64), vectors
