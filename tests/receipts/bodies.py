"""Small, valid receipt bodies for tests (no models, no corpus)."""

from __future__ import annotations

import copy
from typing import Any

from foundation.hashing import sha256_ints, sha256_text
from receipts.schema import build_receipt_body

ROOT = "sha256:" + "a" * 64


def candidate(rank: int, document_id: str = "doc-a", version: int = 1, score: float = 0.5,
              chunk_id: int | None = None) -> dict[str, Any]:
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
        "corpus": {"revision": revision, "root_hash": root_hash},
        "embedder": {"id": "sha256:" + "e" * 64, "identity": {"model": "fake", "batch_size": 1}},
        "retrieval": {"k_candidates": len(cands), "index": {"kind": "flat_ip"},
                      "query_truncated": False},
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
                      "params": {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "seed": 0}},
        "timings": {"queue_ms": 0.5, "ttft_ms": 290.0, "tpot_ms": 21.0, "retrieval_ms": 9.5,
                    "total_ms": 600.0},
        "output": {"text": "Use archive_command.", "text_hash": sha256_text("Use archive_command."),
                   "token_ids_hash": sha256_ints(out_ids), "output_tokens": 3, "token_ids": out_ids},
        "status": status,
        "error": None,
        "software": {"python": "3.11.2", "torch": "2.13.0", "transformers": "5.24", "sentence_transformers":
                     "6.2", "faiss": "1.15", "ragbudget": "0.1.0"},
    }


def body(**kwargs: Any) -> dict[str, Any]:
    """A validated body built from :func:`sections`."""
    return build_receipt_body(**copy.deepcopy(sections(**kwargs)))
