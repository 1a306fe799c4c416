"""Ingesting into the versioned, content-hashed store: one batch, one transaction, one revision.

A batch runs in two phases:

1. *Prepare* (no write lock held): validate and extract every item, normalise
   the text, hash it, chunk it when it differs from the live version, and
   compute missing embeddings. This is the slow part.
2. *Commit* (``foundation.db.write_transaction``, serialised across processes):
   re-read the head, diff against it, and insert documents, versions,
   tombstones, chunks, embeddings and the new ``Revision`` row. Everything
   commits together or nothing does; a batch that changes nothing creates no
   revision.

The read side (``latest_revision``, ``state_at``, ``root_hash``, ...) lives in
``retrieval.revisions`` and is re-exported here.
"""

from __future__ import annotations

import os
import sys
import time
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, insert, select, update
from sqlalchemy.orm import Session

from foundation.db import WriterLock, read_session, write_transaction
from foundation.errors import InvalidInput, RagBudgetError, TooLarge
from foundation.hashing import canonical_json, sha256_bytes, sha256_text
from foundation.provenance import utc_now_iso
from retrieval.chunking import ChunkerConfig, ChunkSpan, chunk_id, chunk_text, chunker_id
from retrieval.extract import check_kind, check_text, extract_text, finish_text
from retrieval.models import Chunk, Document, DocumentVersion, Revision
from retrieval.revisions import (  # noqa: F401  (re-exported API)
    DocumentInfo,
    LiveVersion,
    RevisionInfo,
    VersionInfo,
    get_document,
    get_revision,
    get_version,
    latest_revision,
    list_chunks,
    list_revisions,
    list_versions,
    recompute_root,
    root_hash,
    state_at,
    verify_store,
)
from retrieval.tokens import TextTokenizer

MAX_DOCUMENT_ID_CHARS = 1024
STATUSES = ("added", "updated", "unchanged", "deleted", "rejected")
_IN_BATCH = 500  # ids per IN (...) query, well under SQLite's variable limit

#: Test-only hook: seconds to sleep inside the write transaction after the rows are
#: inserted (and the marker file to create first), so a test can kill the process there.
PAUSE_ENV = "RAGBUDGET_TEST_PAUSE_IN_COMMIT_S"
PAUSE_MARKER_ENV = "RAGBUDGET_TEST_PAUSE_MARKER"


@dataclass
class IngestItem:
    """One document to ingest: ``text`` (already decoded) or ``raw`` bytes of ``kind``."""

    document_id: str
    text: str | None = None
    raw: bytes | None = None
    kind: str = "txt"
    metadata: dict[str, Any] = field(default_factory=dict)
    source_path: str | None = None


@dataclass
class ItemResult:
    """The outcome for one item or deletion; ``code`` and ``reason`` are set when rejected."""

    document_id: str
    status: str
    version: int | None = None
    reason: str | None = None
    code: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class IngestReport:
    """The outcome of one batch. ``revision`` is None when nothing changed."""

    revision: int | None
    previous_revision: int
    results: list[ItemResult]
    root_hash: str | None = None
    live_documents: int | None = None
    chunks_added: int = 0
    embeddings_added: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        """Number of results per status (every status present, zeros included)."""
        out = dict.fromkeys(STATUSES, 0)
        for r in self.results:
            out[r.status] += 1
        return out

    @property
    def rejected(self) -> list[ItemResult]:
        return [r for r in self.results if r.status == "rejected"]

    def to_dict(self) -> dict[str, Any]:
        return {"revision": self.revision, "previous_revision": self.previous_revision,
                "root_hash": self.root_hash, "live_documents": self.live_documents,
                "counts": self.counts, "chunks_added": self.chunks_added,
                "embeddings_added": self.embeddings_added, "timings_ms": self.timings_ms,
                "results": [r.to_dict() for r in self.results]}


@dataclass
class _Prepared:
    index: int
    document_id: str
    text: str
    content_hash: str
    source_hash: str
    metadata_json: str
    chunks: list[ChunkSpan] | None = None


@dataclass(frozen=True)
class _Current:
    version: int
    version_id: int
    is_tombstone: bool
    content_hash: str | None


def check_document_id(document_id: object) -> str:
    """Validate a document id: a non-empty string of at most 1024 characters, no control
    characters, no leading or trailing whitespace. ``/`` is allowed.

    Raises:
        InvalidInput: otherwise.
    """
    if not isinstance(document_id, str) or not document_id:
        raise InvalidInput("document id must be a non-empty string")
    if len(document_id) > MAX_DOCUMENT_ID_CHARS:
        raise InvalidInput(f"document id longer than {MAX_DOCUMENT_ID_CHARS} characters")
    if document_id != document_id.strip() or any(unicodedata.category(c) == "Cc" for c in document_id):
        raise InvalidInput("document id must not contain control characters or leading/trailing "
                           "whitespace")
    return document_id


def prepare_item(item: IngestItem, max_document_bytes: int) -> tuple[str, str, str]:
    """Validate and extract one item; return ``(text, content_hash, source_hash)``.

    The source hash is ``sha256:`` of ``raw``, or of the UTF-8 bytes of ``text`` as given.

    Raises:
        InvalidInput and subclasses: bad id, kind, encoding, size, or no visible content.
    """
    check_document_id(item.document_id)
    kind = check_kind(item.kind)
    if (item.text is None) == (item.raw is None):
        raise InvalidInput("give exactly one of text or raw")
    source = item.raw if item.raw is not None else check_text(str(item.text)).encode("utf-8")
    if len(source) > max_document_bytes:
        raise TooLarge(f"document is {len(source)} bytes; the limit is {max_document_bytes}",
                       size_bytes=len(source), limit_bytes=max_document_bytes)
    if item.raw is not None or kind == "html":
        text = extract_text(source, kind)
    else:
        text = finish_text(str(item.text))
    return text, sha256_text(text), sha256_bytes(source)


def _metadata_json(item: IngestItem, size_bytes: int, source_hash: str) -> str:
    if not isinstance(item.metadata, dict) or not all(isinstance(k, str) for k in item.metadata):
        raise InvalidInput("metadata must be a JSON object with string keys")
    source = {"kind": item.kind, "path": item.source_path, "bytes": size_bytes, "sha256": source_hash}
    return canonical_json({"user": item.metadata, "source": source}).decode("utf-8")


def _current_rows(session: Session, ids: Iterable[str]) -> dict[str, _Current]:
    """The newest row (live version or tombstone, ``live_until_revision IS NULL``) per document."""
    ids = list(dict.fromkeys(ids))
    out: dict[str, _Current] = {}
    for k in range(0, len(ids), _IN_BATCH):
        rows = session.execute(
            select(DocumentVersion.document_id, DocumentVersion.version, DocumentVersion.id,
                   DocumentVersion.is_tombstone, DocumentVersion.content_hash)
            .where(DocumentVersion.document_id.in_(ids[k:k + _IN_BATCH]),
                   DocumentVersion.live_until_revision.is_(None))
        ).all()
        for r in rows:
            out[r[0]] = _Current(r[1], r[2], bool(r[3]), r[4])
    return out


def _progress_bar(progress: bool | Callable[[int, int], None], total: int) -> Callable[[int], None]:
    """A step function for ``progress``: tqdm on stderr (True), a callback ``(done, total)``, or nothing."""
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="doc", file=sys.stderr, desc="ingest", leave=False)

        def step(done: int) -> None:
            bar.update(1)
            if done >= total:
                bar.close()

        return step
    if callable(progress):
        cb = progress
        return lambda done: cb(done, total)
    return lambda done: None


def ingest_batch(
    engine: Engine,
    items: Sequence[IngestItem],
    *,
    tokenizer: TextTokenizer,
    chunker_config: ChunkerConfig,
    embedder: Any = None,
    delete_ids: Sequence[str] = (),
    note: str | None = None,
    progress: bool | Callable[[int, int], None] = False,
    max_document_bytes: int = 20 * 2**20,
    embed_token_count: Callable[[str], int] | None = None,
) -> IngestReport:
    """Ingest ``items`` and delete ``delete_ids`` as one batch: one transaction, at most one revision.

    Per item: ``added`` (new id, or re-added after deletion), ``updated`` (content
    hash differs from the live version: version n+1), ``unchanged`` (same content
    hash: nothing written), or ``rejected`` with ``code``/``reason`` (bad input;
    nothing written for it, the rest of the batch proceeds). Per deletion:
    ``deleted`` (a tombstone) or ``rejected`` (``unknown_document``: not live).

    ``embed_token_count`` (word-pieces incl. [CLS]/[SEP]; default: the embedder's
    ``count_wordpieces``) keeps every chunk within ``chunker_config.max_embed_tokens``.
    With ``embedder``, vectors of new chunk hashes are computed before the
    transaction (``retrieval.embedding``).

    Raises:
        sqlalchemy errors from the database (the batch is then rolled back entirely).
    """
    t0 = time.perf_counter()
    results: dict[int, ItemResult] = {}
    seen: set[str] = set()
    candidates: list[tuple[int, IngestItem]] = []
    for idx, item in enumerate(items):
        if item.document_id in seen:
            results[idx] = _rejected(item.document_id, InvalidInput("duplicate document id in batch"))
            continue
        seen.add(item.document_id)
        candidates.append((idx, item))
    deletes: list[str] = []
    n_items = len(items)
    for k, did in enumerate(delete_ids):
        if did in seen:
            results[n_items + k] = _rejected(did, InvalidInput("document id is both ingested and "
                                                               "deleted in one batch"))
            continue
        seen.add(did)
        deletes.append(did)

    if embed_token_count is None and embedder is not None:
        embed_token_count = getattr(embedder, "count_wordpieces", None)
    cid = chunker_id(chunker_config, tokenizer.tokenizer_id)
    with read_session(engine) as s:
        before = _current_rows(s, (it.document_id for _, it in candidates if isinstance(it.document_id, str)))
    prepared: list[_Prepared] = []
    step = _progress_bar(progress, len(candidates))
    for done, (idx, item) in enumerate(candidates, 1):
        try:
            text, chash, shash = prepare_item(item, max_document_bytes)
            size = len(item.raw) if item.raw is not None else len(str(item.text).encode("utf-8"))
            p = _Prepared(idx, item.document_id, text, chash, shash, _metadata_json(item, size, shash))
            cur = before.get(item.document_id)
            if cur is None or cur.is_tombstone or cur.content_hash != chash:
                p.chunks = chunk_text(text, tokenizer, chunker_config, embed_token_count)
            prepared.append(p)
        except InvalidInput as exc:
            results[idx] = _rejected(item.document_id, exc)
        step(done)
    t_prepared = time.perf_counter()

    vectors: dict[str, Any] = {}
    if embedder is not None:
        from retrieval.embedding import compute_missing

        pairs = _chunk_pairs(prepared)
        if pairs:
            with read_session(engine) as s:
                vectors = compute_missing(s, embedder, pairs, progress=bool(progress))
    t_embedded = time.perf_counter()

    with write_transaction(engine, WriterLock.CORPUS) as session:
        report = _commit(session, prepared, deletes, results, n_items, cid=cid, tokenizer=tokenizer,
                         chunker_config=chunker_config, embed_token_count=embed_token_count,
                         embedder=embedder, vectors=vectors, note=note)
    t_done = time.perf_counter()
    report.timings_ms = {"prepare_ms": (t_prepared - t0) * 1e3, "embed_ms": (t_embedded - t_prepared) * 1e3,
                         "commit_ms": (t_done - t_embedded) * 1e3, "total_ms": (t_done - t0) * 1e3}
    return report


def _rejected(document_id: object, exc: RagBudgetError) -> ItemResult:
    return ItemResult(str(document_id), "rejected", reason=exc.message, code=exc.code)


def _chunk_pairs(prepared: Iterable[_Prepared]) -> list[tuple[str, str]]:
    pairs: dict[str, str] = {}
    for p in prepared:
        for c in p.chunks or ():
            pairs.setdefault(c.chunk_hash, c.text)
    return list(pairs.items())


def _commit(session: Session, prepared: list[_Prepared], deletes: list[str],
            results: dict[int, ItemResult], n_items: int, *, cid: str, tokenizer: TextTokenizer,
            chunker_config: ChunkerConfig, embed_token_count: Callable[[str], int] | None,
            embedder: Any, vectors: dict[str, Any], note: str | None) -> IngestReport:
    """The write phase, inside the serialised transaction (see the module docstring)."""
    head = latest_revision(session)
    current = _current_rows(session, [p.document_id for p in prepared] + deletes)
    revision = head + 1
    new_versions: list[tuple[_Prepared, int, bool]] = []  # (item, version, document exists)
    superseded: list[int] = []
    tombstones: list[tuple[str, int]] = []
    for p in prepared:
        cur = current.get(p.document_id)
        if cur is not None and not cur.is_tombstone and cur.content_hash == p.content_hash:
            results[p.index] = ItemResult(p.document_id, "unchanged", version=cur.version)
            continue
        version = cur.version + 1 if cur is not None else 1
        status = "updated" if cur is not None and not cur.is_tombstone else "added"
        results[p.index] = ItemResult(p.document_id, status, version=version)
        if cur is not None:
            superseded.append(cur.version_id)
        if p.chunks is None:  # changed by a concurrent writer since the pre-read
            p.chunks = chunk_text(p.text, tokenizer, chunker_config, embed_token_count)
        new_versions.append((p, version, cur is not None))
    for k, did in enumerate(deletes):
        cur = current.get(did)
        if cur is None or cur.is_tombstone:
            results[n_items + k] = ItemResult(did, "rejected", reason=f"no live document {did!r}",
                                              code="unknown_document")
            continue
        results[n_items + k] = ItemResult(did, "deleted", version=cur.version + 1)
        superseded.append(cur.version_id)
        tombstones.append((did, cur.version + 1))
    ordered = [results[k] for k in sorted(results)]
    if not new_versions and not tombstones:
        return IngestReport(revision=None, previous_revision=head, results=ordered)

    live: dict[str, str] = {
        r[0]: str(r[1]) for r in session.execute(
            select(DocumentVersion.document_id, DocumentVersion.content_hash)
            .where(DocumentVersion.live_until_revision.is_(None), DocumentVersion.is_tombstone.is_(False)))
    }
    for p, _, _ in new_versions:
        live[p.document_id] = p.content_hash
    for did, _ in tombstones:
        live.pop(did, None)
    counts = {s: sum(1 for r in ordered if r.status == s) for s in STATUSES}
    root = root_hash(list(live.items()))
    session.add(Revision(number=revision, created_at=utc_now_iso(), root_hash=root, live_documents=len(live),
                         added=counts["added"], updated=counts["updated"], deleted=counts["deleted"],
                         unchanged=counts["unchanged"], note=note))
    session.flush()
    new_docs = [Document(id=p.document_id, created_revision=revision) for p, _, exists in new_versions
                if not exists]
    if new_docs:
        session.add_all(new_docs)
        session.flush()
    for k in range(0, len(superseded), _IN_BATCH):
        session.execute(update(DocumentVersion)
                        .where(DocumentVersion.id.in_(superseded[k:k + _IN_BATCH]))
                        .values(live_until_revision=revision)
                        .execution_options(synchronize_session=False))
    rows = [DocumentVersion(document_id=p.document_id, version=v, is_tombstone=False,
                            content_hash=p.content_hash, source_hash=p.source_hash, text=p.text,
                            metadata_json=p.metadata_json, chunker_id=cid, live_from_revision=revision)
            for p, v, _ in new_versions]
    rows += [DocumentVersion(document_id=did, version=v, is_tombstone=True, metadata_json="{}",
                             live_from_revision=revision) for did, v in tombstones]
    session.add_all(rows)
    session.flush()
    chunk_rows = [
        {"id": chunk_id(p.document_id, v, c.ordinal), "version_id": row.id, "ordinal": c.ordinal,
         "start_char": c.start_char, "end_char": c.end_char, "n_tokens": c.n_tokens,
         "chunk_hash": c.chunk_hash, "text": c.text}
        for (p, v, _), row in zip(new_versions, rows, strict=False) for c in p.chunks or ()
    ]
    for k in range(0, len(chunk_rows), 5000):
        session.execute(insert(Chunk), chunk_rows[k:k + 5000])
    _pause_for_tests()
    n_embeddings = 0
    if embedder is not None:
        from retrieval.embedding import compute_missing, insert_embeddings

        missing = [pc for pc in _chunk_pairs(p for p, _, _ in new_versions) if pc[0] not in vectors]
        if missing:
            vectors = {**vectors, **compute_missing(session, embedder, missing, progress=False)}
        n_embeddings = insert_embeddings(session, embedder, vectors)
    return IngestReport(revision=revision, previous_revision=head, results=ordered, root_hash=root,
                        live_documents=len(live), chunks_added=len(chunk_rows),
                        embeddings_added=n_embeddings)


def _pause_for_tests() -> None:
    """Sleep inside the open write transaction when :data:`PAUSE_ENV` is set (kill -9 tests only)."""
    seconds = os.environ.get(PAUSE_ENV)
    if not seconds:
        return
    marker = os.environ.get(PAUSE_MARKER_ENV)
    if marker:
        Path(marker).write_text(str(os.getpid()))
    time.sleep(float(seconds))
