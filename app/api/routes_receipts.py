"""Receipts (operator): list with filters and paging, one receipt with freshness, replay.

``GET /v1/receipts``, ``GET /v1/receipts/{id}``, ``POST /v1/receipts/{id}/replay``.
Receipt bodies hold the question and the exact context, so every route needs
the ``operator`` role (or ``admin``).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import get_services, require_role
from app.services import Services

router = APIRouter(tags=["receipts"], dependencies=[Depends(require_role("operator"))])


class ReceiptSummary(BaseModel):
    """One receipt in a listing (no candidates, no output text).

    ``seq``: position in the hash chain (1-based, newest highest); ``id``: the receipt id;
    ``created_at``: ISO-8601 UTC time the receipt was written; ``status``: ``ok``,
    ``cancelled``, ``failed`` or ``interrupted`` (the serving process died mid-answer;
    recorded at its next start, no output); ``hash``: the receipt's ``sha256:`` hash as stored in the
    chain; ``question``: the question asked; ``revision``: the corpus revision the answer
    was retrieved at; ``chosen_k``: chunks placed in the prompt; ``budget_ms``: the TTFT
    budget in milliseconds; ``ttft_ms``: the measured time to first token in milliseconds
    (null when no token came); ``model_id``: the generator's model. Fields a receipt does
    not record are null.
    """

    seq: int
    id: str | None
    created_at: str | None
    status: str | None
    hash: str
    question: str | None
    revision: int | None
    chosen_k: int | None
    budget_ms: float | None
    ttft_ms: float | None
    within_budget: bool | None = Field(None, description="measured TTFT <= budget; null without a TTFT")
    model_id: str | None


class ReceiptPage(BaseModel):
    """One page of ``GET /v1/receipts``: receipts newest first, and the cursor to the next page."""

    receipts: list[ReceiptSummary]
    next_cursor: str | None = Field(None, description="Pass as ?cursor= for the next page; null on the last")


class FreshnessDocument(BaseModel):
    """The state of one document version a receipt's retrieval returned, against the latest revision.

    ``document_id``, ``version``: the version the receipt recorded; ``cited``: it was among
    the first ``chosen_k`` candidates (the model was shown it); ``status``: ``current`` (still
    live), ``superseded`` (a newer version replaced it), ``deleted`` (the document was
    removed) or ``unknown`` (no such version in the store); ``superseded_by``: the version
    that replaced it; ``changed_at_revision``: the corpus revision at which it stopped being
    live; ``current_version``: the document's live version now (null when deleted).
    """

    document_id: str
    version: int
    cited: bool
    status: Literal["current", "superseded", "deleted", "unknown"]
    superseded_by: int | None
    changed_at_revision: int | None
    current_version: int | None


class Freshness(BaseModel):
    """Has the context a receipt was built on changed since (``receipts.freshness``)?

    ``receipt_revision``: the corpus revision the receipt pinned; ``latest_revision``: the
    store's latest revision now; ``changed``: true when any cited version is no longer
    current; ``counts``: cited versions per status (``current``, ``superseded``, ``deleted``,
    ``unknown``); ``documents``: one entry per distinct (document, version) among the
    candidates, in first-rank order.
    """

    receipt_revision: int | None
    latest_revision: int | None
    changed: bool
    counts: dict[str, int]
    documents: list[FreshnessDocument]


class ReceiptDetail(BaseModel):
    """``GET /v1/receipts/{id}``: the full receipt body and the freshness of its document versions."""

    receipt: dict[str, Any] = Field(..., description="The full receipt body (canonical JSON object)")
    freshness: Freshness


class ReplayRequest(BaseModel):
    """Options of ``POST /v1/receipts/{id}/replay``; the body may be left out (no regeneration)."""

    model_config = ConfigDict(strict=True)  # JSON types as documented: no true -> 1, no "5" -> 5
    regenerate: bool = Field(False, description="Also generate again and compare output tokens")


class ReplayCheck(BaseModel):
    """One replay check (``receipts.replay``).

    ``name``: ``receipt_hash``, ``chain_link``, ``corpus_root``, ``retrieval``, ``embedder``,
    ``stored_chunks``, ``prompt`` or ``regenerate``; ``status``: ``ok``, ``failed`` or
    ``skipped`` (its hook is not available; it neither passes nor fails the replay); ``ok``:
    the check passed; ``expected`` / ``actual``: what the receipt recorded and what the
    replay found (any JSON value, check-specific); ``detail``: one line for people.
    """

    name: str
    status: Literal["ok", "failed", "skipped"]
    ok: bool
    expected: Any = None
    actual: Any = None
    detail: str


class ReplayReportPublic(BaseModel):
    """What a replay found: every check, the receipt's freshness, and how long it took.

    ``receipt_id``, ``seq``: the receipt replayed and its chain position; ``ok``: no check
    failed (skipped checks do not count); ``elapsed_ms``: wall time of the replay in
    milliseconds, rounded to 0.001 ms.
    """

    receipt_id: str
    seq: int
    ok: bool
    checks: list[ReplayCheck]
    freshness: Freshness | None
    elapsed_ms: float


@router.get("/v1/receipts", response_model=ReceiptPage)
def list_(
    since: str | None = Query(None, description="ISO-8601 time, inclusive"),
    until: str | None = Query(None, description="ISO-8601 time, exclusive"),
    document_id: str | None = Query(None, max_length=1024, description="answers that used this document"),
    document_version: int | None = Query(None, ge=1, le=2**31 - 1),
    status: Literal["ok", "cancelled", "failed", "interrupted"] | None = None,
    within_budget: bool | None = Query(None, description="measured TTFT within (true) or over (false) "
                                       "the budget; receipts without a TTFT match neither"),
    limit: int = Query(50, ge=1, le=1000),
    cursor: str | None = Query(None, max_length=32),
    services: Services = Depends(get_services),
) -> ReceiptPage:
    """Receipts newest first. 422 ``invalid_input`` on a bad time or cursor."""
    from receipts.chain import list_receipts

    page, next_cursor = list_receipts(services.engine, since=since, until=until, document_id=document_id,
                                      document_version=document_version, status=status,
                                      within=within_budget, limit=limit,
                                      cursor=cursor)
    return ReceiptPage(receipts=[ReceiptSummary(**r) for r in page], next_cursor=next_cursor)


@router.get("/v1/receipts/{receipt_id}", response_model=ReceiptDetail)
def get(receipt_id: str, services: Services = Depends(get_services)) -> ReceiptDetail:
    """One receipt's body and the freshness of its document versions. 404 ``unknown_receipt``
    (also for an answer's ``pending`` receipt until the spool appends it), 503
    ``database_unavailable`` while the database is away."""
    from receipts.chain import get_receipt
    from receipts.freshness import freshness

    body = get_receipt(services.engine, receipt_id)
    return ReceiptDetail(receipt=body, freshness=Freshness(**freshness(services.engine, body)))


@router.post("/v1/receipts/{receipt_id}/replay", response_model=ReplayReportPublic)
def replay_(receipt_id: str, body: ReplayRequest | None = None,
            services: Services = Depends(get_services)) -> ReplayReportPublic:
    """Replay a receipt: every check with expected/actual, plus freshness. 404 ``unknown_receipt``.

    A failed check is a finding, not an HTTP error: the response is 200 with ``ok: false``.
    """
    from app.answering.receipt_wiring import replay_receipt

    report = replay_receipt(services, receipt_id, regenerate=bool(body and body.regenerate))
    return ReplayReportPublic(**report.to_dict())
