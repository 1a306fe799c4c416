"""Tuning in the console: ``GET /ui/tuning`` (question + budget in, the per-k curve out).

The plan is :meth:`app.answering.pipeline.AnswerPipeline.advise` on the app's own pipeline,
the service behind ``POST /v1/advise`` and ``GET /v1/advise/curve``; the overlay
is the last ``ragbudget sweep`` (:func:`app.sweep.load_last`); the profile plot is
the profile in force (:func:`app.profile_store.current_profile`). A GET: planning
changes nothing.
"""

from __future__ import annotations

import threading
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import Response

from app.answering.pipeline import AnswerPipeline
from app.answering.state import AnswerRequest
from app.services import Services
from app.ui.charts import curve_svg, profile_svg
from app.ui.web import ConsoleRoute, ConsoleUser, console_user, get_services, render
from foundation.errors import InvalidInput, NotFound

router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)

_PROFILE_SVG: dict[str, str | None] = {}  # profile id -> SVG (a profile's content never changes)
_PROFILE_LOCK = threading.Lock()


def get_pipeline(request: Request) -> AnswerPipeline:
    """The app's answer pipeline (the one ``/v1/advise`` uses)."""
    return request.app.state.pipeline  # type: ignore[no-any-return]


def _profile_plot(profile: Any) -> str | None:
    with _PROFILE_LOCK:
        if profile.id not in _PROFILE_SVG:
            if len(_PROFILE_SVG) > 16:
                _PROFILE_SVG.clear()
            _PROFILE_SVG[profile.id] = profile_svg(profile)
        return _PROFILE_SVG[profile.id]


def _number(value: str, name: str, *, integer: bool = False) -> float | int | None:
    value = value.strip()
    if not value:
        return None
    try:
        return int(value) if integer else float(value)
    except ValueError:
        raise InvalidInput(f"{name} must be a {'whole ' if integer else ''}number", field=name) from None


def _sweep_overlay(services: Services, profile_id: str) -> dict[str, Any] | None:
    from app.sweep import load_last

    last = load_last(services.data_dir)
    if last is None:
        return None
    meta = last.get("meta") or {}
    same = meta.get("profile_id") == profile_id
    label = (f"last sweep ({str(last.get('created_at', ''))[:16]}): measured median, "
             f"{meta.get('n_questions', '?')} questions")
    return {"per_k": last["summary"].get("per_k") or [], "label": label, "created_at": last.get("created_at"),
            "meta": meta, "same_profile": same, "per_budget": last["summary"].get("per_budget") or []}


@router.get("/ui/tuning")
def tuning(request: Request, question: str = Query("", max_length=100_000),
           budget_ms: str = Query("", max_length=32), k_max: str = Query("", max_length=12),
           user: ConsoleUser = Depends(console_user), services: Services = Depends(get_services),
           pipeline: AnswerPipeline = Depends(get_pipeline)) -> Response:
    """The tuning form; with a question, the per-k table and curve (predicted p50/p95 with the
    budget line, prompt tokens, the chunk each k adds, the chosen k) with the last sweep's
    measured points, and the profile's measured-vs-predicted plot. A bad input re-renders
    the form with its error (422)."""
    form = {"question": question, "budget_ms": budget_ms, "k_max": k_max}
    error, advice, rows, chart = "", None, [], None
    if question.strip():
        try:
            advice = pipeline.advise(AnswerRequest(
                question=question, ttft_budget_ms=_number(budget_ms, "budget_ms"),
                k_max=_number(k_max, "k_max", integer=True)))  # type: ignore[arg-type]
        except (InvalidInput, NotFound) as exc:
            error = exc.message
    profile = pipeline.profile()
    sweep = _sweep_overlay(services, profile.id)
    if advice is not None:
        plan = advice.plan.model_dump()
        cands = [c.model_dump() for c in advice.candidates]
        for r in plan["rows"]:
            k = int(r["k"])
            rows.append({**r, "adds": cands[k - 1] if 1 <= k <= len(cands) else None,
                         "ttft_p50_total_ms": r["ttft_p50_ms"] + plan["overhead_ms"],
                         "ttft_p95_total_ms": r["ttft_p95_ms"] + plan["overhead_ms"]})
        chart = curve_svg(plan["rows"], overhead_ms=plan["overhead_ms"], budget_ms=plan["budget_ms"],
                          chosen_k=plan["chosen_k"], sweep=sweep)
    return render(request, "tuning.html", status_code=422 if error else 200, user=user, section="tuning",
                  form=form, error=error, advice=advice, rows=rows, chart=chart, sweep=sweep,
                  profile=profile, profile_chart=_profile_plot(profile))
