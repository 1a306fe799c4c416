"""Synthetic receipts and a tiny hand-written store, for tests and benchmarks without models.

Bodies: :func:`candidate`, :func:`sections` (keyword sections for
``receipts.schema.build_receipt_body``) and :func:`body` give small, valid
receipt bodies. Store: :func:`make_revision_1` and :func:`make_revisions_2_3`
write this history straight into the tables (revision: change):

  1: doc-a v1 (chunks 1001, 1003), doc-b v1 (chunk 1002), doc-c v1 (chunk 1004) added
  2: doc-a updated to v2 (chunk 2001)
  3: doc-b deleted (tombstone v2)

and :class:`FakeRetriever` ranks its chunks deterministically (a hash of query
and chunk text as the score), pinned by revision, so the receipts side of an
answer and of replay (hash and link, pinned root, prompt rebuild, freshness)
runs without an embedder or a generator. Nothing here is used on the answer path.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Engine, select, update

from foundation.db import WriterLock, read_session, write_transaction
from foundation.hashing import sha256_ints, sha256_json, sha256_text
from receipts.schema import build_receipt_body
from retrieval.models import Chunk, Document, DocumentVersion, Revision

#: The corpus root hash the default bodies pin.
ROOT = "sha256:" + "a" * 64


def candidate(rank: int, document_id: str = "doc-a", version: int = 1, score: float = 0.5,
              chunk_id: int | None = None) -> dict[str, Any]:
    """One retrieval candidate of a receipt (``chunk_id`` defaults to ``1000 + rank``)."""
    cid = chunk_id if chunk_id is not None else 1000 + rank
    return {"rank": rank, "score": score, "chunk_id": cid, "document_id": document_id,
            "version": version, "chunk_hash": sha256_text(f"chunk {cid}")}


def sections(question: str = "How do I archive WAL?", *, status: str = "ok",
             candidates: list[dict[str, Any]] | None = None, revision: int = 1,
             root_hash: str = ROOT, chosen_k: int = 2) -> dict[str, Any]:
    """Keyword sections for ``build_receipt_body``; override what a test needs."""
    cands = candidates if candidates is not None else [
        candidate(1, "doc-a", 1, 0.8125), candidate(2, "doc-b", 1, 0.71875), candidate(3, "doc-a", 1, 0.5)]
    out_ids = [5, 6, 7]
    return {
        "question": question,
        "request": {"messages": [{"role": "user", "content": question}], "user": None},
        "corpus": {"revision": revision, "root_hash": root_hash},
        "embedder": {"id": "sha256:" + "e" * 64, "identity": {"model": "fake", "batch_size": 1}},
        "retrieval": {"k_candidates": len(cands), "index": {"kind": "flat_ip"},
                      "query_truncated": False, "query": question},
        "candidates": cands,
        "plan": {"budget_ms": 800.0, "chosen_k": chosen_k, "binding": "budget",
                 "predicted_ttft_p50_ms": 310.5, "predicted_ttft_p95_ms": 402.25,
                 "profile_id": "prof-1", "profile_source": "fitted", "overhead_ms": 12.0,
                 "rows": [{"k": 0, "p95_ms": 100.0}, {"k": 1, "p95_ms": 250.0}]},
        "scaffold": {"id": 1, "name": "default", "hash": sha256_text("scaffold")},
        "prompt": {"token_ids_hash": sha256_ints([1, 2, 3]), "prompt_tokens": 300,
                   "cached_tokens": 120, "computed_tokens": 180},
        "generator": {"backend": "local", "model_id": "smollm2-135m", "weights_hash": "sha256:" + "b" * 64,
                      "dtype": "float32", "device": "cpu",
                      "params": {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "seed": 0,
                                 "stop": []}},
        "timings": {"queue_ms": 0.5, "ttft_ms": 290.0, "tpot_ms": 21.0, "retrieval_ms": 9.5,
                    "total_ms": 600.0},
        "output": {"text": "Use archive_command.", "text_hash": sha256_text("Use archive_command."),
                   "token_ids_hash": sha256_ints(out_ids), "output_tokens": 3, "token_ids": out_ids,
                   "finish_reason": "stop", "stop_sequence": None},
        "status": status,
        "error": None,
        "software": {"python": "3.11.2", "torch": "2.13.0", "transformers": "5.24", "sentence_transformers":
                     "6.2", "faiss": "1.15", "ragbudget": "0.1.0"},
    }


def body(**kwargs: Any) -> dict[str, Any]:
    """A validated body built from :func:`sections`."""
    return build_receipt_body(**copy.deepcopy(sections(**kwargs)))


# --- the store and the fake retriever ------------------------------------------------------------

#: The embedder id the fake retriever reports.
EMBEDDER_ID = "sha256:" + "e" * 64
#: Chunk id -> chunk text of the synthetic store.
TEXTS = {1001: "WAL archiving copies segments with archive_command.",
         1003: "restore_command fetches archived segments.",
         1002: "autovacuum removes dead tuples.",
         1004: "pg_dump writes a logical backup.",
         2001: "WAL archiving now also supports archive_library."}


def root(revision: int) -> str:
    """The synthetic root hash of ``revision`` (``sha256_json({"revision": n})``)."""
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
    """Write revision 1 (doc-a, doc-b, doc-c) into an empty store."""
    with write_transaction(engine, WriterLock.CORPUS) as s:
        _revision(s, 1)
        for doc in ("doc-a", "doc-b", "doc-c"):
            s.add(Document(id=doc, created_revision=1))
        s.flush()
        _version(s, "doc-a", 1, 1, [1001, 1003])
        _version(s, "doc-b", 1, 1, [1002])
        _version(s, "doc-c", 1, 1, [1004])


def make_revisions_2_3(engine: Engine) -> None:
    """Write revisions 2 (doc-a v2) and 3 (doc-b deleted) on top of :func:`make_revision_1`."""
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
    """One ranked chunk, shaped like ``retrieval.retriever``'s hits."""

    rank: int
    score: float
    chunk_id: int
    document_id: str
    version: int
    chunk_hash: str
    text: str


@dataclass
class Result:
    """A retrieval result pinned to ``revision``, shaped like ``retrieval.retriever``'s."""

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
        """The ``k`` best chunks live at ``revision`` (default: the latest); ties by chunk id."""
        self.calls += 1
        with read_session(self.engine) as s:
            rev = int(revision or s.scalar(select(Revision.number).order_by(Revision.number.desc())) or 0)
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
    """Replay's prompt-rebuild hook over :func:`fake_prompt`: ``(token_ids_hash, n_tokens)``."""
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
