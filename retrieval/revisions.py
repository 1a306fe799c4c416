"""Reading the store: revisions, the live state at any revision, documents and their versions.

All functions take an open SQLAlchemy ``Session`` (``foundation.db.read_session``
or a write transaction) and never write. Liveness follows
``retrieval.models.DocumentVersion``: a version row is live at revision R iff
``live_from_revision <= R`` and (``live_until_revision`` is NULL or ``> R``)
and it is not a tombstone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session, defer

from foundation.bounds import check_int64
from foundation.errors import UnknownDocument, UnknownRevision, UnknownVersion
from foundation.hashing import sha256_json
from retrieval.document_ids import lookup_document_id
from retrieval.models import Chunk, Document, DocumentVersion, Revision


@dataclass(frozen=True)
class LiveVersion:
    """One live document version at a revision."""

    document_id: str
    version: int
    version_id: int
    content_hash: str


@dataclass(frozen=True)
class RevisionInfo:
    """A committed revision: number, ISO-8601 UTC time, counts and root hash."""

    number: int
    created_at: str
    root_hash: str
    live_documents: int
    added: int
    updated: int
    deleted: int
    unchanged: int
    note: str | None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class VersionInfo:
    """A document version or tombstone. ``text`` is None in listings; ``metadata`` is the
    caller's metadata; ``source`` holds kind, path, byte size and ``sha256`` of the source bytes;
    ``front_matter`` a Markdown document's YAML front matter (kept out of its text), else None."""

    document_id: str
    version: int
    version_id: int
    is_tombstone: bool
    content_hash: str | None
    source_hash: str | None
    chunker_id: str | None
    live_from_revision: int
    live_until_revision: int | None
    metadata: dict[str, Any]
    source: dict[str, Any]
    text: str | None = None
    n_chunks: int | None = None
    front_matter: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class DocumentInfo:
    """A document: ``current`` is its live version (with text), None once deleted."""

    id: str
    created_revision: int
    n_versions: int
    latest_version: int
    is_deleted: bool
    current: VersionInfo | None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


#: Ids per ``IN (...)`` query, well under SQLite's bound-variable limit.
IN_BATCH = 500


@dataclass(frozen=True)
class CurrentRow:
    """A document's newest row (live version or tombstone): its version, row id and content hash."""

    version: int
    version_id: int
    is_tombstone: bool
    content_hash: str | None


def current_rows(session: Session, ids: Iterable[str]) -> dict[str, CurrentRow]:
    """The newest row (``live_until_revision IS NULL``) per document id; ids never stored are absent."""
    ids = list(dict.fromkeys(ids))
    out: dict[str, CurrentRow] = {}
    for k in range(0, len(ids), IN_BATCH):
        rows = session.execute(
            select(DocumentVersion.document_id, DocumentVersion.version, DocumentVersion.id,
                   DocumentVersion.is_tombstone, DocumentVersion.content_hash)
            .where(DocumentVersion.document_id.in_(ids[k:k + IN_BATCH]),
                   DocumentVersion.live_until_revision.is_(None))
        ).all()
        for r in rows:
            out[r[0]] = CurrentRow(r[1], r[2], bool(r[3]), r[4])
    return out


def root_hash(pairs: list[tuple[str, str]]) -> str:
    """Root over live documents: ``sha256_json`` of the sorted ``[document_id, content_hash]`` list.

    An empty corpus hashes ``[]``. Order of ``pairs`` does not matter.
    """
    return sha256_json(sorted([str(d), str(h)] for d, h in pairs))


def latest_revision(session: Session) -> int:
    """The newest committed revision number; 0 for an empty store."""
    return int(session.scalar(select(func.coalesce(func.max(Revision.number), 0))) or 0)


def _revision_info(row: Revision) -> RevisionInfo:
    return RevisionInfo(number=row.number, created_at=row.created_at, root_hash=row.root_hash,
                        live_documents=row.live_documents, added=row.added, updated=row.updated,
                        deleted=row.deleted, unchanged=row.unchanged, note=row.note)


def get_revision(session: Session, number: int) -> RevisionInfo:
    """Revision ``number``.

    Raises:
        InvalidInput: ``number`` is not an integer in the signed 64-bit range.
        UnknownRevision: no such revision.
    """
    row = session.get(Revision, check_int64(number, "revision"))
    if row is None:
        raise UnknownRevision(f"no revision {number} (latest is {latest_revision(session)})",
                              revision=number)
    return _revision_info(row)


def list_revisions(session: Session, *, limit: int | None = None, offset: int = 0,
                   newest_first: bool = False) -> list[RevisionInfo]:
    """Revisions ordered by number (ascending unless ``newest_first``), paged by ``limit``/``offset``."""
    order = Revision.number.desc() if newest_first else Revision.number.asc()
    q = select(Revision).order_by(order).offset(max(0, check_int64(offset, "offset")))
    if limit is not None:
        q = q.limit(max(0, check_int64(limit, "limit")))
    return [_revision_info(r) for r in session.scalars(q)]


def live_at_clause(revision: int) -> Any:
    """SQL condition: a ``DocumentVersion`` row is live (and not a tombstone) at ``revision``."""
    return (
        (DocumentVersion.live_from_revision <= revision)
        & or_(DocumentVersion.live_until_revision.is_(None),
              DocumentVersion.live_until_revision > revision)
        & DocumentVersion.is_tombstone.is_(False)
    )


def state_at(session: Session, revision: int) -> list[LiveVersion]:
    """Exactly the versions live at ``revision``, sorted by document id.

    Revision 0 (before the first ingest) is the empty corpus.

    Raises:
        UnknownRevision: ``revision`` is negative or newer than the latest.
    """
    revision = int(revision)
    if revision < 0 or revision > latest_revision(session):
        raise UnknownRevision(f"no revision {revision} (latest is {latest_revision(session)})",
                              revision=revision)
    rows = session.execute(
        select(DocumentVersion.document_id, DocumentVersion.version, DocumentVersion.id,
               DocumentVersion.content_hash)
        .where(live_at_clause(revision)).order_by(DocumentVersion.document_id)
    ).all()
    return [LiveVersion(r[0], r[1], r[2], str(r[3])) for r in rows]


def recompute_root(session: Session, revision: int) -> str:
    """The root hash recomputed from :func:`state_at` (compare with the stored one)."""
    return root_hash([(v.document_id, v.content_hash) for v in state_at(session, revision)])


def _version_info(row: DocumentVersion, *, with_text: bool, n_chunks: int | None = None) -> VersionInfo:
    meta = json.loads(row.metadata_json or "{}")
    return VersionInfo(
        document_id=row.document_id, version=row.version, version_id=row.id,
        is_tombstone=bool(row.is_tombstone), content_hash=row.content_hash,
        source_hash=row.source_hash, chunker_id=row.chunker_id,
        live_from_revision=row.live_from_revision, live_until_revision=row.live_until_revision,
        metadata=meta.get("user", {}), source=meta.get("source", {}),
        text=row.text if with_text else None, n_chunks=n_chunks, front_matter=meta.get("front_matter"))


def _n_chunks(session: Session, version_id: int) -> int:
    return int(session.scalar(select(func.count()).select_from(Chunk)
                              .where(Chunk.version_id == version_id)) or 0)


def get_document(session: Session, document_id: str) -> DocumentInfo:
    """A document with its current live version (text included).

    Raises:
        UnknownDocument: the id was never ingested.
    """
    document_id = lookup_document_id(document_id)
    doc = session.get(Document, document_id)
    if doc is None:
        raise UnknownDocument(f"no document {document_id!r}", document_id=document_id)
    rows = list(session.scalars(select(DocumentVersion).where(DocumentVersion.document_id == document_id)
                                .order_by(DocumentVersion.version)))
    last = rows[-1]
    live = last if not last.is_tombstone and last.live_until_revision is None else None
    current = _version_info(live, with_text=True, n_chunks=_n_chunks(session, live.id)) if live else None
    return DocumentInfo(id=doc.id, created_revision=doc.created_revision,
                        n_versions=sum(1 for r in rows if not r.is_tombstone),
                        latest_version=last.version, is_deleted=bool(last.is_tombstone), current=current)


def list_versions(session: Session, document_id: str) -> list[VersionInfo]:
    """Every version and tombstone of a document, oldest first, without text.

    Raises:
        UnknownDocument: the id was never ingested.
    """
    document_id = lookup_document_id(document_id)
    rows = list(session.scalars(select(DocumentVersion).where(DocumentVersion.document_id == document_id)
                                .order_by(DocumentVersion.version)))
    if not rows:
        raise UnknownDocument(f"no document {document_id!r}", document_id=document_id)
    return [_version_info(r, with_text=False) for r in rows]


def get_version(session: Session, document_id: str, version: int) -> VersionInfo:
    """Version ``version`` of a document, with its text and chunk count.

    Raises:
        UnknownDocument: the id was never ingested.
        UnknownVersion: the document has no such version.
    """
    document_id = lookup_document_id(document_id)
    version = check_int64(version, "version", lo=1)
    row = session.scalar(select(DocumentVersion).where(DocumentVersion.document_id == document_id,
                                                       DocumentVersion.version == int(version)))
    if row is None:
        if session.get(Document, document_id) is None:
            raise UnknownDocument(f"no document {document_id!r}", document_id=document_id)
        raise UnknownVersion(f"document {document_id!r} has no version {version}",
                             document_id=document_id, version=version)
    return _version_info(row, with_text=True, n_chunks=_n_chunks(session, row.id))


def changes_at(session: Session, revision: int, *, limit: int | None = None,
               offset: int = 0) -> list[VersionInfo]:
    """What revision ``revision`` changed: the versions and tombstones that became live in it,
    by document id, without text, paged by ``limit``/``offset``."""
    q = (select(DocumentVersion).options(defer(DocumentVersion.text))
         .where(DocumentVersion.live_from_revision == int(revision))
         .order_by(DocumentVersion.document_id).offset(max(0, offset)))
    if limit is not None:
        q = q.limit(max(0, limit))
    return [_version_info(r, with_text=False) for r in session.scalars(q)]


def list_chunks(session: Session, version_id: int) -> list[Chunk]:
    """The chunks of one document version, by ordinal."""
    return list(session.scalars(select(Chunk).where(Chunk.version_id == version_id).order_by(Chunk.ordinal)))


def verify_store(session: Session, revisions: list[int] | None = None) -> list[str]:
    """Check the store's invariants; return a list of problems (empty when consistent).

    Checks: revisions are numbered 1..N; for each checked revision (default all),
    the stored root and live count equal those recomputed from :func:`state_at`;
    each document's versions are 1..n, each superseded exactly when the next
    begins, only the newest open; no row points past revision N; every
    non-tombstone version has chunks with ordinals 0..k-1, tombstones have none;
    no document without versions.
    """
    problems: list[str] = []
    numbers = list(session.scalars(select(Revision.number).order_by(Revision.number)))
    head = numbers[-1] if numbers else 0
    if numbers != list(range(1, head + 1)):
        problems.append(f"revision numbers are not 1..{head}: {numbers[:10]}...")
    for n in numbers if revisions is None else revisions:
        info = get_revision(session, n)
        state = state_at(session, n)
        if recompute_root(session, n) != info.root_hash:
            problems.append(f"revision {n}: stored root does not match its live documents")
        if len(state) != info.live_documents:
            problems.append(f"revision {n}: live_documents {info.live_documents} != {len(state)}")
    rows = session.execute(select(DocumentVersion.document_id, DocumentVersion.version,
                                  DocumentVersion.live_from_revision, DocumentVersion.live_until_revision,
                                  DocumentVersion.is_tombstone, DocumentVersion.id)
                           .order_by(DocumentVersion.document_id, DocumentVersion.version)).all()
    chunks: dict[int, list[int]] = {}
    for vid, ordinal in session.execute(select(Chunk.version_id, Chunk.ordinal)):
        chunks.setdefault(vid, []).append(ordinal)
    by_doc: dict[str, list[Any]] = {}
    for r in rows:
        by_doc.setdefault(r[0], []).append(r)
    for doc_id in session.scalars(select(Document.id)):
        if doc_id not in by_doc:
            problems.append(f"document {doc_id!r} has no versions")
    for doc_id, versions in by_doc.items():
        if [v[1] for v in versions] != list(range(1, len(versions) + 1)):
            problems.append(f"document {doc_id!r}: versions are not 1..{len(versions)}")
        for older, newer in zip(versions, versions[1:], strict=False):
            if older[3] != newer[2]:
                problems.append(f"document {doc_id!r}: v{older[1]} ends at {older[3]}, "
                                f"v{newer[1]} starts at {newer[2]}")
        if versions[-1][3] is not None:
            problems.append(f"document {doc_id!r}: newest version is closed")
        for v in versions:
            if v[2] > head or (v[3] is not None and v[3] > head):
                problems.append(f"document {doc_id!r} v{v[1]} points past revision {head}")
            ordinals = sorted(chunks.get(v[5], []))
            if v[4] and ordinals:
                problems.append(f"document {doc_id!r} v{v[1]} is a tombstone with chunks")
            if not v[4] and ordinals != list(range(len(ordinals))) or (not v[4] and not ordinals):
                problems.append(f"document {doc_id!r} v{v[1]}: chunk ordinals {ordinals[:5]}...")
    known = {v[5] for v in rows}
    if set(chunks) - known:
        problems.append(f"{len(set(chunks) - known)} chunk groups belong to no version")
    return problems
