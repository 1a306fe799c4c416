"""What a receipt page shows, assembled from the same services the REST API uses.

The body comes from :func:`receipts.chain.get_receipt`, freshness from
:func:`receipts.freshness.freshness`, chunk texts from
:func:`receipts.stored.stored_hits`; nothing here recomputes a plan, a replay or
a freshness state. The only derived figure is the prefill time, named as such:
``TTFT - queue wait - pre-prefill overhead`` (the pipeline measures overhead
from arrival to the planned prompt, then waits for the model, then prefills;
see :mod:`app.answering.pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from app.answering.types import ChunkHit
from receipts.chain import get_receipt, within_budget
from receipts.freshness import freshness
from receipts.schema import candidate_slots
from receipts.stored import stored_hits

BINDING_TEXT = {
    "budget": "the TTFT budget binds: one more chunk would exceed it at p95",
    "context_window": "the context window binds: one more chunk would not fit with the answer's tokens",
    "candidates_exhausted": "every retrieved candidate fits: the number of candidates K binds",
    "nothing_fits": "nothing fits: even the prompt without chunks exceeds the budget at p95",
    "arrivals": "requests that arrived meanwhile bind: one more chunk would leave one of them "
                "too little prefill time to answer within its budget",
}


class CandidateView(ChunkHit):
    """One candidate chunk as shown: the chunk (:class:`app.answering.types.ChunkHit`), whether
    it was cited, its document version's freshness, its text (if stored)."""

    cited: bool
    status: str
    superseded_by: int | None
    changed_at_revision: int | None
    text: str | None
    problem: str | None = None


@dataclass
class ReceiptView:
    """Everything the receipt page renders (see the template ``receipt.html``)."""

    body: dict[str, Any]
    freshness: dict[str, Any]
    cited: list[CandidateView] = field(default_factory=list)
    others: list[CandidateView] = field(default_factory=list)
    plan_rows: list[dict[str, Any]] = field(default_factory=list)
    chosen_k: int | None = None
    binding: str | None = None
    binding_text: str = ""
    within_budget: bool | None = None
    prefill_ms: float | None = None


def _candidates(engine: Engine, body: dict[str, Any], fresh: dict[str, Any],
                chosen_k: int) -> tuple[list[CandidateView], list[CandidateView]]:
    hits, problems = stored_hits(engine, body, cited_only=False)
    texts = {h.chunk_id: h.text for h in hits}
    trouble = {int(p["chunk_id"]): p["detail"] for p in problems}
    states = {(d["document_id"], d["version"]): d for d in fresh["documents"]}
    cited: list[CandidateView] = []
    others: list[CandidateView] = []
    for c, slot in zip(body.get("candidates") or [], candidate_slots(body), strict=True):
        state = states.get((c["document_id"], c["version"]), {})
        view = CandidateView(
            **ChunkHit.fields_of(c), cited=slot <= chosen_k,
            status=state.get("status", "unknown"), superseded_by=state.get("superseded_by"),
            changed_at_revision=state.get("changed_at_revision"), text=texts.get(int(c["chunk_id"])),
            problem=trouble.get(int(c["chunk_id"])))
        (cited if view.cited else others).append(view)
    return cited, others


def prefill_ms(body: dict[str, Any]) -> float | None:
    """Prefill (with the first decode step): measured TTFT minus queue wait and pre-prefill
    overhead (retrieval when the overhead was not recorded); None without a TTFT."""
    t = body.get("timings") or {}
    if t.get("ttft_ms") is None:
        return None
    overhead = t.get("overhead_ms")
    if overhead is None:
        overhead = (body.get("plan") or {}).get("overhead_ms")
    if overhead is None:
        overhead = t.get("retrieval_ms") or 0.0
    return max(0.0, float(t["ttft_ms"]) - float(t.get("queue_ms") or 0.0) - float(overhead))


def receipt_view(engine: Engine, receipt_id: str) -> ReceiptView:
    """The receipt page's content for ``receipt_id``.

    Raises:
        UnknownReceipt: no receipt has that id.
        IntegrityFailure: the stored body is not a JSON object.
    """
    body = get_receipt(engine, receipt_id)
    fresh = freshness(engine, body)
    plan = body.get("plan") or {}
    chosen_k = int(plan.get("chosen_k") or 0) if plan else 0
    cited, others = _candidates(engine, body, fresh, chosen_k)
    binding = plan.get("binding")
    return ReceiptView(body=body, freshness=fresh, cited=cited, others=others,
                       plan_rows=list(plan.get("rows") or []), chosen_k=plan.get("chosen_k"),
                       binding=binding, binding_text=BINDING_TEXT.get(binding or "", binding or ""),
                       within_budget=within_budget(body), prefill_ms=prefill_ms(body))
