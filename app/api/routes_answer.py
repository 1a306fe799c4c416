"""Answer and advise routes: ``POST /v1/answer``, ``POST /v1/advise``, ``GET /v1/advise/curve``."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from app.answering.pipeline import AnswerPipeline
from app.answering.state import AnswerEvent, AnswerRequest
from app.answering.types import Advice, AdviceCurve, Answer
from app.api.answer_headers import answer_headers, plan_headers
from app.api.clock import arrival_of, auth_ms_of
from app.api.deps import require_role
from app.api.streaming import iterate_in_thread
from generation.base import MAX_SEED

router = APIRouter(tags=["answers"])

MAX_REVISION = 2**31 - 1  # revisions are 32-bit integers in the database
# ``stream: true`` answers are server-sent events; the schema describes one event (OpenAPI 3.1 usage).
SSE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"description": "JSON, or server-sent events with stream: true",
          "content": {"text/event-stream": {"schema": {
              "type": "object", "required": ["data"],
              "properties": {"event": {"type": "string", "description": "token, final or error"},
                             "data": {"type": "string", "description": "a JSON object, or [DONE]"}}}}}}}


def get_pipeline(request: Request) -> AnswerPipeline:
    """The app's answer pipeline (one per app: one queue, one metrics registry)."""
    return request.app.state.pipeline  # type: ignore[no-any-return]


class AnswerCreate(BaseModel):
    """An answer request. ``ttft_budget_ms`` defaults to the configured budget."""

    # JSON types as documented (no true -> 1, no "5" -> 5); unknown fields are rejected.
    model_config = ConfigDict(strict=True, extra="forbid")
    question: str = Field(..., max_length=100_000, description="non-blank (422 empty_question)")
    ttft_budget_ms: float | None = Field(None, description="TTFT budget in ms (>0)")
    max_new_tokens: int | None = Field(None, ge=1)
    revision: int | None = Field(None, ge=1, le=MAX_REVISION)
    k_max: int | None = Field(None, ge=1)
    stream: bool = False
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="0..2**53-1 (a JSON-safe integer)")
    on_budget_miss: Literal["answer", "reject"] | None = Field(
        None, description="when even k=0 cannot make the budget: answer anyway (binding nothing_fits) "
        "or refuse with 503 budget_unreachable, Retry-After and no receipt; default: the server's "
        "setting (RAGBUDGET_ON_BUDGET_MISS)")

    def to_request(self) -> AnswerRequest:
        """The pipeline's request (``app.answering.state.AnswerRequest``); ``stream`` stays with the route."""
        return AnswerRequest(question=self.question, ttft_budget_ms=self.ttft_budget_ms,
                             max_new_tokens=self.max_new_tokens, revision=self.revision,
                             k_max=self.k_max, temperature=self.temperature, top_p=self.top_p,
                             seed=self.seed, on_budget_miss=self.on_budget_miss)


class AdviseCreate(BaseModel):
    """An advise request: retrieve and plan, no generation."""

    # JSON types as documented (no true -> 1, no "5" -> 5); unknown fields are rejected.
    model_config = ConfigDict(strict=True, extra="forbid")
    question: str = Field(..., max_length=100_000, description="non-blank (422 empty_question)")
    ttft_budget_ms: float | None = Field(
        None, description="TTFT budget in ms (>0); default: the configured budget")
    revision: int | None = Field(None, ge=1, le=MAX_REVISION)
    k_max: int | None = Field(None, ge=1)
    max_new_tokens: int | None = Field(None, ge=1)


def sse(event: str, data: Any) -> bytes:
    """One server-sent event (``event:`` line + one ``data:`` line of JSON; models are dumped)."""
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, default=str)}\n\n".encode()


@router.post("/v1/answer", dependencies=[Depends(require_role("copilot"))], response_model=Answer,
             responses=SSE_RESPONSE)
async def answer(body: AnswerCreate, request: Request, response: Response,
                 pipeline: AnswerPipeline = Depends(get_pipeline)) -> Any:
    """Retrieve, plan for the TTFT budget, generate, write a receipt.

    Non-streaming: the :class:`~app.answering.types.Answer` with ``text``, ``chosen_k``, ``citations``,
    ``predicted`` (p50/p95 TTFT ms, profile id and source), ``timings``
    (queue_ms, ttft_ms, tpot_ms, retrieval_ms), ``tokens``, ``receipt_id`` and ``receipt_status``:
    ``written`` (in the chain), ``pending`` (the database was away when the answer ended: the
    receipt is spooled and appended as ``receipt_id`` once it is back; ``receipt_error`` says
    why) or ``failed`` (no receipt with the output; docs/receipts.md, the receipt spool).
    Streaming (``stream: true``): ``text/event-stream`` of ``token`` events
    (``{"text"}``), then one ``final`` event with the same summary (or an
    ``error`` event when generation failed mid-way), then ``data: [DONE]``.
    Headers (:mod:`app.api.answer_headers`): the receipt id, chosen k, binding, budget and
    predicted TTFT, sent when the answer gets the model (streamed) or with the answer, then
    with the measured TTFT as well.

    Errors: 400 ``malformed_body`` (not JSON), 422 bad input (codes ``empty_question``,
    ``invalid_budget``, ``invalid_request`` for schema violations such as unknown fields),
    404 ``unknown_revision``, 429 ``busy`` with Retry-After, 503 ``budget_unreachable`` with
    Retry-After and ``details.predicted_ttft_ms`` (``on_budget_miss: reject`` and even k = 0 is
    predicted over budget; no receipt).
    """
    arrival, auth_ms = arrival_of(request), auth_ms_of(request)
    cancel = threading.Event()
    req = body.to_request()
    events = iterate_in_thread(lambda: pipeline.stream(req, cancel=cancel, arrival_t=arrival,
                                                       auth_ms=auth_ms),
                               cancel, request)
    # Validation errors raise here -> 4xx; else the answer has the model (admitted) or left the queue.
    first: AnswerEvent = await events.__anext__()
    if not body.stream:
        final = first
        async for ev in events:
            final = ev
        assert final.summary is not None, "the pipeline ends every stream with a summary"
        response.headers.update(answer_headers(final.summary))
        return final.summary

    async def gen() -> AsyncIterator[bytes]:
        ev: AnswerEvent | None = first
        try:
            while ev is not None:
                if ev.kind == "token":
                    yield sse("token", {"text": ev.text})
                elif ev.kind != "admitted":  # its figures went out as headers
                    yield sse(ev.kind, ev.summary)
                ev = await anext(events, None)
        except Exception as exc:  # never a silent cut
            yield sse("error", {"code": getattr(exc, "code", "internal_error"), "message": str(exc)})
        yield b"data: [DONE]\n\n"

    plan = first.admission or first.summary  # a summary only when it left the queue unanswered
    headers = plan_headers(plan) if plan is not None else {}
    return StreamingResponse(gen(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


@router.post("/v1/advise", dependencies=[Depends(require_role("copilot"))], response_model=Advice)
def advise(body: AdviseCreate, request: Request,
           pipeline: AnswerPipeline = Depends(get_pipeline)) -> Advice:
    """Retrieve and plan: the per-k table (prompt/cached/computed tokens, predicted TTFT p50/p95,
    fits budget, fits context), the chosen k with its binding reason, and the profile used
    (``source``: fitted or prior). Errors: 422 ``invalid_budget`` / ``empty_question``, 404."""
    return pipeline.advise(AnswerRequest(question=body.question, ttft_budget_ms=body.ttft_budget_ms,
                                         revision=body.revision, k_max=body.k_max,
                                         max_new_tokens=body.max_new_tokens),
                           arrival_of(request), auth_ms_of(request))


@router.get("/v1/advise/curve", dependencies=[Depends(require_role("copilot"))],
            response_model=AdviceCurve)
def advise_curve(question: str = Query(..., max_length=100_000),
                 ttft_budget_ms: float | None = Query(None),
                 k_max: int | None = Query(None, ge=1),
                 revision: int | None = Query(None, ge=1, le=MAX_REVISION),
                 pipeline: AnswerPipeline = Depends(get_pipeline)) -> AdviceCurve:
    """The per-k curve for a user interface: same rows as ``/v1/advise``, budget optional."""
    return AdviceCurve.of(pipeline.advise(AnswerRequest(
        question=question, ttft_budget_ms=ttft_budget_ms, revision=revision, k_max=k_max)))
