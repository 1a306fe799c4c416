"""A tiny stand-in for the store: writes revisions, versions, chunks (and vectors) through the ORM.

Documents are chunked on blank lines with exact character offsets; chunk ids
are the first 63 bits of ``sha256(document id, version, ordinal)``, like the
store's deterministic ids. Each :meth:`FixtureCorpus.commit` is one revision.
"""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime

from sqlalchemy import Engine, func, select

from foundation.db import WriterLock, write_transaction
from foundation.hashing import normalize_text, sha256_json, sha256_text
from retrieval.embedding import Embedder, compute_missing, insert_embeddings
from retrieval.models import Chunk, Document, DocumentVersion, Revision

_PARA = re.compile(r"\S(?:.*?\S)?(?=\n\s*\n|\s*\Z)", re.S)


def chunk_id(document_id: str, version: int, ordinal: int) -> int:
    """Deterministic int63 chunk id."""
    d = hashlib.sha256(f"{document_id}\x00{version}\x00{ordinal}".encode()).digest()
    return int.from_bytes(d[:8], "big") & (2**63 - 1)


def paragraphs(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` offsets of the non-blank paragraphs of ``text``."""
    return [(m.start(), m.end()) for m in _PARA.finditer(text)]


class FixtureCorpus:
    """Writes corpus history directly; ``embedder`` (optional) embeds at commit, like ingest."""

    def __init__(self, engine: Engine, embedder: Embedder | None = None) -> None:
        self.engine = engine
        self.embedder = embedder

    def commit(self, changes: dict[str, str | None], ids: dict[str, int] | None = None) -> int:
        """Apply ``{document id: text}`` (``None`` deletes) as one revision; return its number.

        ``ids`` optionally fixes the chunk id of a single-chunk document (for tie tests).
        """
        with write_transaction(self.engine, WriterLock.CORPUS) as s:
            rev = int(s.execute(select(func.coalesce(func.max(Revision.number), 0))).scalar_one()) + 1
            row = Revision(number=rev, created_at=datetime.now(UTC).isoformat(), root_hash="pending",
                           live_documents=0)
            s.add(row)
            s.flush()
            pairs: list[tuple[str, str]] = []
            for doc_id in sorted(changes):
                text = changes[doc_id]
                if s.get(Document, doc_id) is None:
                    s.add(Document(id=doc_id, created_revision=rev))
                    s.flush()
                prev = s.execute(select(DocumentVersion).where(DocumentVersion.document_id == doc_id)
                                 .order_by(DocumentVersion.version.desc()).limit(1)).scalar()
                if prev is not None and prev.live_until_revision is None:
                    prev.live_until_revision = rev
                number = prev.version + 1 if prev is not None else 1
                if text is None:
                    s.add(DocumentVersion(document_id=doc_id, version=number, is_tombstone=True,
                                          live_from_revision=rev, live_until_revision=None))
                    continue
                text = normalize_text(text)
                ver = DocumentVersion(document_id=doc_id, version=number, is_tombstone=False,
                                      content_hash=sha256_text(text), text=text,
                                      live_from_revision=rev)
                s.add(ver)
                s.flush()
                for ordinal, (a, b) in enumerate(paragraphs(text)):
                    piece = text[a:b]
                    cid = (ids or {}).get(doc_id) if len(paragraphs(text)) == 1 else None
                    chash = sha256_text(piece)
                    s.add(Chunk(id=cid if cid is not None else chunk_id(doc_id, number, ordinal),
                                version_id=ver.id, ordinal=ordinal, start_char=a, end_char=b,
                                n_tokens=len(piece.split()), chunk_hash=chash, text=piece))
                    pairs.append((chash, piece))
            s.flush()
            live = s.execute(select(DocumentVersion.document_id, DocumentVersion.content_hash).where(
                DocumentVersion.live_until_revision.is_(None),
                DocumentVersion.is_tombstone.is_(False))).all()
            row.root_hash = sha256_json(sorted([d, h] for d, h in live))
            row.live_documents = len(live)
            if self.embedder is not None and pairs:
                insert_embeddings(s, self.embedder, compute_missing(s, self.embedder, pairs))
        return rev
