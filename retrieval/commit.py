"""The commit phase of an ingest batch: diff against the head and write, inside the serialised
transaction (``foundation.db.write_transaction`` with ``WriterLock.CORPUS``).

:func:`commit_batch` re-reads the newest row of every id under the lock,
decides each item's status (``added`` / ``updated`` / ``unchanged``; a deletion
``deleted`` or ``rejected``), and, when anything changed, inserts the new
``Revision`` with its root hash, new ``Document`` rows, the versions and
tombstones (closing the superseded rows' ``live_until_revision``), the chunks,
and the embeddings of new chunk hashes. It runs inside the caller's
transaction, so everything commits together or nothing does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from foundation.provenance import utc_now_iso
from retrieval.boilerplate import LearnedBlock, stored_boilerplate
from retrieval.chunking import ChunkerConfig, chunk_id, chunk_text
from retrieval.models import BoilerplateBlock, Chunk, Document, DocumentVersion, Revision
from retrieval.prepare import ItemResult, Prepared, chunk_pairs
from retrieval.revisions import IN_BATCH, current_rows, latest_revision, root_hash
from retrieval.tokens import TextTokenizer

STATUSES = ("added", "updated", "unchanged", "deleted", "rejected", "skipped")
_INSERT_BATCH = 5000  # chunk rows per executemany

#: Test-only hook: seconds to sleep inside the write transaction after the rows are
#: inserted (and the marker file to create first), so a test can kill the process there.
PAUSE_ENV = "RAGBUDGET_TEST_PAUSE_IN_COMMIT_S"
PAUSE_MARKER_ENV = "RAGBUDGET_TEST_PAUSE_MARKER"


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
        """The rejected results, in batch order."""
        return [r for r in self.results if r.status == "rejected"]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form printed by ``ragbudget ingest --json``."""
        return {"revision": self.revision, "previous_revision": self.previous_revision,
                "root_hash": self.root_hash, "live_documents": self.live_documents,
                "counts": self.counts, "chunks_added": self.chunks_added,
                "embeddings_added": self.embeddings_added, "timings_ms": self.timings_ms,
                "results": [r.to_dict() for r in self.results]}


@dataclass
class _Plan:
    """What the batch writes: ``(item, version, document exists)`` per new version, the row ids
    to close, and ``(document id, version)`` per tombstone."""

    new_versions: list[tuple[Prepared, int, bool]] = field(default_factory=list)
    superseded: list[int] = field(default_factory=list)
    tombstones: list[tuple[str, int]] = field(default_factory=list)


def commit_batch(session: Session, prepared: list[Prepared], deletes: list[str],
                 results: dict[int, ItemResult], n_items: int, *, cid: str, tokenizer: TextTokenizer,
                 chunker_config: ChunkerConfig, embed_token_count: Callable[[str], int] | None,
                 embedder: Any, vectors: dict[str, Any], note: str | None,
                 boilerplate: dict[str, LearnedBlock] | None = None) -> IngestReport:
    """Diff ``prepared`` and ``deletes`` against the head and write them as one new revision.

    ``results`` holds the rejections found so far by batch position (items
    ``0..n_items-1``, then deletions) and receives every other outcome.
    ``vectors`` are the embeddings computed before the lock (by chunk hash);
    chunk hashes they miss (a concurrent writer changed the head) are embedded here.
    ``boilerplate`` (learned by this batch and dropped from its pages) is stored, except
    blocks already stored, with the new revision's number (None when nothing else changed).
    """
    head = latest_revision(session)
    plan = _decide(session, prepared, deletes, results, n_items, tokenizer, chunker_config,
                   embed_token_count)
    ordered = [results[k] for k in sorted(results)]
    if not plan.new_versions and not plan.tombstones:
        _write_boilerplate(session, boilerplate or {}, None)
        return IngestReport(revision=None, previous_revision=head, results=ordered)
    revision = head + 1
    live = _live_after(session, plan)
    counts = {s: sum(1 for r in ordered if r.status == s) for s in STATUSES}
    root = root_hash(list(live.items()))
    session.add(Revision(number=revision, created_at=utc_now_iso(), root_hash=root, live_documents=len(live),
                         added=counts["added"], updated=counts["updated"], deleted=counts["deleted"],
                         unchanged=counts["unchanged"], note=note))
    session.flush()
    _write_boilerplate(session, boilerplate or {}, revision)
    n_chunks = _write_versions(session, plan, revision, cid)
    _pause_for_tests()
    n_embeddings = _write_embeddings(session, plan, embedder, vectors)
    return IngestReport(revision=revision, previous_revision=head, results=ordered, root_hash=root,
                        live_documents=len(live), chunks_added=n_chunks, embeddings_added=n_embeddings)


def _decide(session: Session, prepared: list[Prepared], deletes: list[str], results: dict[int, ItemResult],
            n_items: int, tokenizer: TextTokenizer, chunker_config: ChunkerConfig,
            embed_token_count: Callable[[str], int] | None) -> _Plan:
    """Each item's and deletion's status against the newest rows read under the lock."""
    current = current_rows(session, [p.document_id for p in prepared] + deletes)
    plan = _Plan()
    for p in prepared:
        cur = current.get(p.document_id)
        if cur is not None and not cur.is_tombstone and cur.content_hash == p.content_hash:
            results[p.index] = ItemResult(p.document_id, "unchanged", version=cur.version)
            continue
        version = cur.version + 1 if cur is not None else 1
        status = "updated" if cur is not None and not cur.is_tombstone else "added"
        results[p.index] = ItemResult(p.document_id, status, version=version)
        if cur is not None:
            plan.superseded.append(cur.version_id)
        if p.chunks is None:  # changed by a concurrent writer since the pre-read
            p.chunks = chunk_text(p.text, tokenizer, chunker_config, embed_token_count)
        plan.new_versions.append((p, version, cur is not None))
    for k, did in enumerate(deletes):
        cur = current.get(did)
        if cur is None or cur.is_tombstone:
            results[n_items + k] = ItemResult(did, "rejected", reason=f"no live document {did!r}",
                                              code="unknown_document")
            continue
        results[n_items + k] = ItemResult(did, "deleted", version=cur.version + 1)
        plan.superseded.append(cur.version_id)
        plan.tombstones.append((did, cur.version + 1))
    return plan


def _live_after(session: Session, plan: _Plan) -> dict[str, str]:
    """Document id -> content hash of every live version once ``plan`` is applied."""
    live: dict[str, str] = {
        r[0]: str(r[1]) for r in session.execute(
            select(DocumentVersion.document_id, DocumentVersion.content_hash)
            .where(DocumentVersion.live_until_revision.is_(None), DocumentVersion.is_tombstone.is_(False)))
    }
    for p, _, _ in plan.new_versions:
        live[p.document_id] = p.content_hash
    for did, _ in plan.tombstones:
        live.pop(did, None)
    return live


def _write_versions(session: Session, plan: _Plan, revision: int, cid: str) -> int:
    """Insert new documents, close superseded rows, insert versions, tombstones and chunks.

    Returns the number of chunk rows inserted.
    """
    new_docs = [Document(id=p.document_id, created_revision=revision) for p, _, exists in plan.new_versions
                if not exists]
    if new_docs:
        session.add_all(new_docs)
        session.flush()
    for k in range(0, len(plan.superseded), IN_BATCH):
        session.execute(update(DocumentVersion)
                        .where(DocumentVersion.id.in_(plan.superseded[k:k + IN_BATCH]))
                        .values(live_until_revision=revision)
                        .execution_options(synchronize_session=False))
    rows = [DocumentVersion(document_id=p.document_id, version=v, is_tombstone=False,
                            content_hash=p.content_hash, source_hash=p.source_hash, text=p.text,
                            metadata_json=p.metadata_json, chunker_id=cid, live_from_revision=revision)
            for p, v, _ in plan.new_versions]
    rows += [DocumentVersion(document_id=did, version=v, is_tombstone=True, metadata_json="{}",
                             live_from_revision=revision) for did, v in plan.tombstones]
    session.add_all(rows)
    session.flush()
    chunk_rows = [
        {"id": chunk_id(p.document_id, v, c.ordinal), "version_id": row.id, "ordinal": c.ordinal,
         "start_char": c.start_char, "end_char": c.end_char, "n_tokens": c.n_tokens,
         "chunk_hash": c.chunk_hash, "text": c.text}
        for (p, v, _), row in zip(plan.new_versions, rows, strict=False) for c in p.chunks or ()
    ]
    for k in range(0, len(chunk_rows), _INSERT_BATCH):
        session.execute(insert(Chunk), chunk_rows[k:k + _INSERT_BATCH])
    return len(chunk_rows)


def _write_boilerplate(session: Session, blocks: dict[str, LearnedBlock], revision: int | None) -> None:
    """Insert the learned blocks not stored yet (a concurrent batch may have stored some)."""
    if not blocks:
        return
    stored = stored_boilerplate(session)
    now = utc_now_iso()
    rows = [{"block_hash": k, "text": b.text, "pages": b.pages, "batch_pages": b.batch_pages,
             "revision": revision, "created_at": now} for k, b in sorted(blocks.items()) if k not in stored]
    if rows:
        session.execute(insert(BoilerplateBlock), rows)


def _write_embeddings(session: Session, plan: _Plan, embedder: Any, vectors: dict[str, Any]) -> int:
    """Store the vectors of the new chunk hashes (embedding here those ``vectors`` misses)."""
    if embedder is None:
        return 0
    from retrieval.embedding import compute_missing, insert_embeddings

    missing = [pc for pc in chunk_pairs(p for p, _, _ in plan.new_versions) if pc[0] not in vectors]
    if missing:
        vectors = {**vectors, **compute_missing(session, embedder, missing, progress=False)}
    return insert_embeddings(session, embedder, vectors)


def _pause_for_tests() -> None:
    """Sleep inside the open write transaction when :data:`PAUSE_ENV` is set (kill -9 tests only)."""
    seconds = os.environ.get(PAUSE_ENV)
    if not seconds:
        return
    marker = os.environ.get(PAUSE_MARKER_ENV)
    if marker:
        Path(marker).write_text(str(os.getpid()))
    time.sleep(float(seconds))
