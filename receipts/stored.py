"""The context a receipt recorded, loaded back from the store.

Nothing in the store is overwritten (docs/store.md, "Semantics"), so the chunks a receipt names
stay readable after their documents were updated or deleted. This module loads
them by chunk id and checks that each still belongs to the recorded document
version and still has the recorded chunk hash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, select

from foundation.db import read_session
from foundation.hashing import sha256_text
from receipts.schema import cited_candidates
from retrieval.models import Chunk, DocumentVersion


@dataclass(frozen=True)
class StoredHit:
    """A recorded candidate with its stored text (same attribute names as a retrieval hit)."""

    rank: int
    score: float
    chunk_id: int
    document_id: str
    version: int
    chunk_hash: str
    text: str
    start_char: int
    end_char: int
    n_tokens: int
    slot: int | None = None  # the prompt slot recorded for it (None: a receipt from before slots)


def stored_hits(engine: Engine, body: dict[str, Any], *,
                cited_only: bool = True) -> tuple[list[StoredHit], list[dict[str, Any]]]:
    """Load a receipt's candidates (the cited ones by default) from the store, in rank order.

    Returns:
        ``(hits, problems)``: ``hits`` has one :class:`StoredHit` per candidate found
        intact; ``problems`` one ``{"rank", "chunk_id", "expected", "actual", "detail"}``
        per candidate missing, moved to another document version, or whose hash differs
        (in the row, or recomputed over its text).
    """
    cands = cited_candidates(body) if cited_only else list(body.get("candidates") or [])
    ids = [int(c["chunk_id"]) for c in cands]
    rows: dict[int, Any] = {}
    with read_session(engine) as session:
        for start in range(0, len(ids), 500):
            for found in session.execute(
                select(Chunk.id, Chunk.chunk_hash, Chunk.text, Chunk.start_char, Chunk.end_char,
                       Chunk.n_tokens,
                       DocumentVersion.document_id, DocumentVersion.version)
                .join(DocumentVersion, DocumentVersion.id == Chunk.version_id)
                .where(Chunk.id.in_(ids[start:start + 500]))):
                rows[found.id] = found
    hits: list[StoredHit] = []
    problems: list[dict[str, Any]] = []
    for c in cands:
        row = rows.get(int(c["chunk_id"]))
        where = {"rank": c["rank"], "chunk_id": str(c["chunk_id"])}
        if row is None:
            problems.append({**where, "expected": c["chunk_hash"], "actual": None,
                             "detail": "chunk not found in the store"})
            continue
        if (row.document_id, row.version) != (c["document_id"], c["version"]):
            problems.append({**where, "expected": f"{c['document_id']} v{c['version']}",
                             "actual": f"{row.document_id} v{row.version}",
                             "detail": "chunk belongs to another document version"})
            continue
        if row.chunk_hash != c["chunk_hash"] or sha256_text(row.text) != c["chunk_hash"]:
            problems.append({**where, "expected": c["chunk_hash"], "actual": sha256_text(row.text),
                             "detail": "stored chunk text no longer matches the recorded hash"})
            continue
        hits.append(StoredHit(rank=c["rank"], score=c["score"], chunk_id=row.id,
                              document_id=row.document_id, version=row.version, chunk_hash=row.chunk_hash,
                              text=row.text, start_char=row.start_char, end_char=row.end_char,
                              n_tokens=row.n_tokens, slot=c.get("slot")))
    return hits, problems
