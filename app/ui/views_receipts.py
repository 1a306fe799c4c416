"""Receipts in the console: the filtered list, one receipt, and its replay.

``GET /ui/receipts`` (filters: time range, status, document, within budget; pages by
cursor), ``GET /ui/receipts/{id}``, ``POST /ui/receipts/{id}/replay`` (CSRF-checked;
``regenerate`` optional). The list is :func:`receipts.chain.list_receipts`, the page
:func:`app.ui.receipt_view.receipt_view`, the replay
:func:`app.answering.receipt_wiring.replay_receipt`: the services behind ``/v1/receipts``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import Response

from app.services import Services
from app.ui.receipt_view import receipt_view
from app.ui.web import ConsoleRoute, ConsoleUser, check_csrf, console_user, form_fields, get_services, render
from foundation.errors import InvalidInput

router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)

PAGE_SIZE = 25
WITHIN = {"": None, "yes": True, "no": False}


def _time(value: str) -> str | None:
    """A ``datetime-local`` value (``YYYY-MM-DDTHH:MM``, read as UTC) or ISO-8601 time; None if blank."""
    value = value.strip()
    return value or None


@router.get("/ui/receipts")
def receipts_list(request: Request, since: str = Query("", max_length=40),
                  until: str = Query("", max_length=40), status: str = Query("", max_length=16),
                  document: str = Query("", max_length=1024),
                  version: str = Query("", max_length=12), within: str = Query("", max_length=3),
                  cursor: str = Query("", max_length=32), user: ConsoleUser = Depends(console_user),
                  services: Services = Depends(get_services)) -> Response:
    """Receipts newest first, :data:`PAGE_SIZE` a page. A bad filter re-renders the form with its
    error (422) and no rows."""
    from receipts.chain import list_receipts

    filters = {"since": since, "until": until, "status": status, "document": document, "version": version,
               "within": within}
    error = ""
    rows: list[dict[str, Any]] = []
    next_cursor = None
    try:
        if within not in WITHIN:
            raise InvalidInput("within budget must be yes, no or blank", field="within")
        doc_version = None
        if version.strip():
            if not document.strip():
                raise InvalidInput("a document version needs a document id", field="version")
            if not version.strip().isdigit() or not 1 <= int(version) <= 2**31 - 1:
                raise InvalidInput("the document version must be a positive integer", field="version")
            doc_version = int(version)
        rows, next_cursor = list_receipts(
            services.engine, since=_time(since), until=_time(until), status=status or None,
            document_id=document.strip() or None, document_version=doc_version, within=WITHIN[within],
            limit=PAGE_SIZE, cursor=cursor or None)
    except InvalidInput as exc:
        error = exc.message
    next_url = None
    if next_cursor:
        next_url = "/ui/receipts?" + urlencode({**{k: v for k, v in filters.items() if v},
                                                "cursor": next_cursor})
    return render(request, "receipts.html", status_code=422 if error else 200, user=user,
                  section="receipts", rows=rows, filters=filters, error=error, next_url=next_url,
                  first_page=not cursor)


@router.get("/ui/receipts/{receipt_id}")
def receipt_page(request: Request, receipt_id: str, user: ConsoleUser = Depends(console_user),
                 services: Services = Depends(get_services)) -> Response:
    """One receipt: question, answer, cited chunks and candidates with freshness, the plan,
    predicted vs measured TTFT, timings, tokens, generator and profile, and the Replay form.
    404 page ``unknown_receipt``."""
    view = receipt_view(services.engine, receipt_id)
    return render(request, "receipt.html", user=user, section="receipts", v=view, r=view.body, replay=None)


def _token_context(services: Services, check: dict[str, Any]) -> dict[str, Any] | None:
    """Decoded tokens around the first differing output token of a failed ``regenerate`` check."""
    ctx = (check.get("actual") or {}).get("context") if isinstance(check.get("actual"), dict) else None
    if not ctx:
        return None
    if "recorded_text" in ctx:
        return {"kind": "chars", **ctx}
    tok = services.tokenizer

    def pieces(ids: list[int]) -> list[dict[str, Any]]:
        return [{"index": ctx["start"] + i, "text": tok.decode([t]), "id": t,
                 "differs": ctx["start"] + i == ctx["position"]} for i, t in enumerate(ids)]

    return {"kind": "tokens", "position": ctx["position"], "recorded": pieces(ctx["recorded"]),
            "regenerated": pieces(ctx["regenerated"])}


@router.post("/ui/receipts/{receipt_id}/replay")
def replay(request: Request, receipt_id: str, user: ConsoleUser = Depends(console_user),
           form: dict[str, str] = Depends(form_fields),
           services: Services = Depends(get_services)) -> Response:
    """Replay the receipt (``regenerate=on`` also generates again) and show every check.

    403 page ``csrf_failed`` without the session's CSRF token; 404 ``unknown_receipt``.
    """
    from app.answering.receipt_wiring import replay_receipt

    check_csrf(request, user, form)
    regenerate = form.get("regenerate") in ("on", "1", "true")
    report = replay_receipt(services, receipt_id, regenerate=regenerate).to_dict()
    for check in report["checks"]:
        check["context"] = _token_context(services, check) if check["status"] == "failed" else None
    view = receipt_view(services.engine, receipt_id)
    return render(request, "receipt.html", user=user, section="receipts", v=view, r=view.body,
                  replay=report, regenerate=regenerate)
