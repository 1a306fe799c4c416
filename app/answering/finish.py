"""Finishing an answer: what it shows as it gets the model, and what it leaves when it ends.

:func:`admission_of` is the ``admitted`` event's content (the reserved receipt id and the plan,
before the first token: the API sends them as headers). :func:`failed` records a generation
error on the answer's state. :func:`finish` writes the receipt (or spools it) and the metrics
(:class:`app.answering.receipt.AnswerReceipts`) and hands the trace to the exporter
(:mod:`app.tracing`); :func:`last_event` is the stream's closing ``final`` or ``error`` event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app.answering.receipt import AnswerReceipts
from app.answering.state import Admission, AnswerEvent, InFlight, Prepared
from app.answering.types import Answer, AnswerError
from generation.base import GenParams

if TYPE_CHECKING:
    from app.tracing import AnswerTracer


def admission_of(receipts: AnswerReceipts, p: Prepared, state: InFlight,
                 receipt_id: str | None) -> Admission:
    """The :class:`Admission` of ``p`` as it gets the model (plan and prediction as its summary)."""
    snap, _ids, _prefill = receipts.summary(p, state)
    return Admission(receipt_id=receipt_id, chosen_k=snap.chosen_k, binding=snap.binding,
                     predicted=snap.predicted, ttft_budget_ms=snap.ttft_budget_ms,
                     prompt_tokens=snap.tokens.prompt)


def failed(state: InFlight, exc: Exception) -> None:
    """Record on ``state`` that generation failed with ``exc`` after the stream started: status
    ``failed``, the error's ``code`` (``generation_failed`` for an error without one) and text."""
    state.status = "failed"
    state.error = AnswerError(code=str(getattr(exc, "code", "generation_failed")), message=str(exc))


def finish(receipts: AnswerReceipts, tracer: AnswerTracer | None, p: Prepared, params: GenParams,
           state: InFlight, receipt_id: str | None, identity: Any) -> Answer:
    """The answer's summary, its receipt written (or spooled) and its metrics recorded
    (:meth:`AnswerReceipts.finish`); its trace queued for export when a tracer is set (spans
    sent off the request path, :mod:`app.tracing`; ``identity``: the generator's)."""
    summary = receipts.finish(p, params, state, receipt_id)
    if tracer is not None:
        tracer.export(p, params, summary, identity)
    return summary


def last_event(state: InFlight, summary: Answer) -> AnswerEvent:
    """The stream's closing event: ``error`` for a failed answer, else ``final``."""
    return AnswerEvent("error" if state.status == "failed" else "final", summary=summary)
