"""A tiny versioned store written straight into the tables, and a deterministic fake retriever.

History (revision: change):
  1: doc-a v1 (chunks 1001, 1003), doc-b v1 (chunk 1002), doc-c v1 (chunk 1004) added
  2: doc-a updated to v2 (chunk 2001)
  3: doc-b deleted (tombstone v2)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Engine, select, update

from foundation.db import WriterLock, read_session, write_transaction
from foundation.hashing import sha256_ints, sha256_json, sha256_text
from receipts.schema import build_receipt_body
from retrieval.models import Chunk, Document, DocumentVersion, Revision
from tests.receipts.bodies import sections

EMBEDDER_ID = "sha256:" + "e" * 64
TEXTS = {1001: "WAL archiving copies segments with archive_command.",
         1003: "restore_command fetches archived segments.",
         1002: "autovacuum removes dead tuples.",
         1004: "pg_dump writes a logical backup.",
         2001: "WAL archiving now also supports archive_library."}


def root(revision: int) -> str:
    return sha256_json({"revision": revision})


def _revision(s: Any, n: int) -> None:
    s.add(Revision(number=n, created_at=f"2025-01-0{n}T00:00:00.000000+00:00", root_hash=root(n),
                   live_documents=3))
    s.flush()


def _version(s: Any, doc: str, version: int, rev: int, chunk_ids: list[int], tomb: bool = False) -> None:
    dv = DocumentVersion(document_id=doc, version=version, is_tombstone=tomb, live_from_revision=rev,
                         text=None if tomb else " ".join(TEXTS[c] for c in chunk_ids),
                         content_hash=None if tomb else sha256_text(doc + str(version)))
    s.add(dv)
    s.flush()
    for i, cid in enumerate(chunk_ids):
        s.add(Chunk(id=cid, version_id=dv.id, ordinal=i, start_char=0, end_char=len(TEXTS[cid]),
                    n_tokens=len(TEXTS[cid].split()), chunk_hash=sha256_text(TEXTS[cid]), text=TEXTS[cid]))


def make_revision_1(engine: Engine) -> None:
    with write_transaction(engine, WriterLock.CORPUS) as s:
        _revision(s, 1)
        for doc in ("doc-a", "doc-b", "doc-c"):
            s.add(Document(id=doc, created_revision=1))
        s.flush()
        _version(s, "doc-a", 1, 1, [1001, 1003])
        _version(s, "doc-b", 1, 1, [1002])
        _version(s, "doc-c", 1, 1, [1004])


def make_revisions_2_3(engine: Engine) -> None:
    with write_transaction(engine, WriterLock.CORPUS) as s:
        _revision(s, 2)
        s.execute(update(DocumentVersion).where(DocumentVersion.document_id == "doc-a",
                                                DocumentVersion.version == 1).values(live_until_revision=2))
        _version(s, "doc-a", 2, 2, [2001])
        _revision(s, 3)
        s.execute(update(DocumentVersion).where(DocumentVersion.document_id == "doc-b",
                                                DocumentVersion.version == 1).values(live_until_revision=3))
        _version(s, "doc-b", 2, 3, [], tomb=True)


@dataclass
class Hit:
    rank: int
    score: float
    chunk_id: int
    document_id: str
    version: int
    chunk_hash: str
    text: str


@dataclass
class Result:
    revision: int
    root_hash: str
    embedder_id: str
    hits: list[Hit]


class FakeRetriever:
    """Scores = float32 of a hash of (query, chunk text); exact, deterministic, pinned by revision."""

    def __init__(self, engine: Engine, embedder_id: str = EMBEDDER_ID) -> None:
        self.engine = engine
        self.embedder_id = embedder_id
        self.calls = 0

    def retrieve(self, query: str, k: int, revision: int | None = None) -> Result:
        self.calls += 1
        with read_session(self.engine) as s:
            rev = revision or s.scalar(select(Revision.number).order_by(Revision.number.desc()))
            rows = s.execute(
                select(Chunk.id, Chunk.chunk_hash, Chunk.text, DocumentVersion.document_id,
                       DocumentVersion.version)
                .join(DocumentVersion, DocumentVersion.id == Chunk.version_id)
                .where(DocumentVersion.live_from_revision <= rev,
                       (DocumentVersion.live_until_revision.is_(None))
                       | (DocumentVersion.live_until_revision > rev))).all()
            root_hash = s.scalar(select(Revision.root_hash).where(Revision.number == rev))
        scored = []
        for r in rows:
            digest = hashlib.sha256(f"{query}|{r.text}".encode()).digest()
            score = float(np.float32(int.from_bytes(digest[:4], "big") / 2**32))
            scored.append((-score, r.id, r))
        scored.sort(key=lambda t: (t[0], t[1]))
        hits = [Hit(i + 1, -neg, r.id, r.document_id, r.version, r.chunk_hash, r.text)
                for i, (neg, _, r) in enumerate(scored[:k])]
        return Result(rev, str(root_hash), self.embedder_id, hits)


def fake_prompt(question: str, hits: list[Any]) -> tuple[str, int]:
    """A stand-in prompt builder: 'token ids' are the UTF-8 bytes of the joined texts."""
    ids = list(("\n".join(h.text for h in hits) + "\n" + question).encode())
    return sha256_ints(ids), len(ids)


def rebuild_prompt(body: dict[str, Any], hits: list[Any]) -> tuple[str, int]:
    return fake_prompt(body["question"], hits)


def answer_body(retriever: FakeRetriever, question: str = "how does WAL archiving work",
                k: int = 4, chosen_k: int = 3, revision: int | None = None) -> dict[str, Any]:
    """A receipt body as the pipeline would build it from the fake retriever and prompt."""
    res = retriever.retrieve(question, k, revision)
    s = sections(question=question, revision=res.revision, root_hash=res.root_hash, chosen_k=chosen_k,
                 candidates=[{"rank": h.rank, "score": h.score, "chunk_id": h.chunk_id,
                              "document_id": h.document_id, "version": h.version,
                              "chunk_hash": h.chunk_hash} for h in res.hits])
    s["embedder"]["id"] = res.embedder_id
    s["retrieval"]["k_candidates"] = k
    token_ids_hash, n = fake_prompt(question, res.hits[:chosen_k])
    s["prompt"].update(token_ids_hash=token_ids_hash, prompt_tokens=n)
    return build_receipt_body(**s)
