"""The response headers of an answer (``POST /v1/answer``, ``POST /v1/chat/completions``): the
receipt id and the plan, on streamed and non-streamed responses alike.

The headers are sent when the answer gets the model, before its first token
(:class:`app.answering.state.Admission`), so a client that reads only headers (a benchmark tool,
a proxy log) can tell an answer planned without context (``X-Ragbudget-Chosen-K: 0``,
``X-Ragbudget-Binding: nothing_fits``) from one with context, and fetch the receipt
(``GET /v1/receipts/{id}``) without reading the body:

=====================================  ==================================================
``X-Ragbudget-Receipt-Id``             the receipt id (absent when the journal row could
                                       not be written; the body then says it)
``X-Ragbudget-Chosen-K``               retrieved chunks in the prompt
``X-Ragbudget-Binding``                why k stopped there (``budget``, ``nothing_fits``,
                                       ``context_window``, ``candidates_exhausted``,
                                       ``arrivals``)
``X-Ragbudget-TTFT-Budget-Ms``         the TTFT budget planned for, ms
``X-Ragbudget-Predicted-TTFT-P50-Ms``  predicted TTFT at the chosen k, p50, ms
``X-Ragbudget-Predicted-TTFT-P95-Ms``  the same at p95 (what the planner holds to the budget)
``X-Ragbudget-TTFT-Ms``                measured TTFT, ms: non-streamed responses only (a
                                       streamed one sends its headers before the first
                                       token; the final chunk's ``ragbudget.timings`` has it)
=====================================  ==================================================

The OpenAI response id is ``chatcmpl-`` + the receipt id (:func:`response_id`), so a client's
log of response ids leads to the receipts as well.
"""

from __future__ import annotations

import uuid

from app.answering.state import Admission
from app.answering.types import Answer

RECEIPT_ID = "X-Ragbudget-Receipt-Id"
CHOSEN_K = "X-Ragbudget-Chosen-K"
BINDING = "X-Ragbudget-Binding"
BUDGET_MS = "X-Ragbudget-TTFT-Budget-Ms"
PREDICTED_P50_MS = "X-Ragbudget-Predicted-TTFT-P50-Ms"
PREDICTED_P95_MS = "X-Ragbudget-Predicted-TTFT-P95-Ms"
TTFT_MS = "X-Ragbudget-TTFT-Ms"
#: Every header above.
ALL = (RECEIPT_ID, CHOSEN_K, BINDING, BUDGET_MS, PREDICTED_P50_MS, PREDICTED_P95_MS, TTFT_MS)
#: The prefix of an OpenAI chat completion id; the receipt id follows it.
CHAT_ID_PREFIX = "chatcmpl-"


def _ms(value: float | None) -> str | None:
    return None if value is None else f"{value:.1f}"


def plan_headers(plan: Admission | Answer) -> dict[str, str]:
    """The headers of ``plan`` (an answer's admission, or its final summary): receipt id, chosen
    k, binding, budget and predicted TTFT; a value that is not known is left out."""
    values = {RECEIPT_ID: plan.receipt_id, CHOSEN_K: str(plan.chosen_k), BINDING: plan.binding,
              BUDGET_MS: _ms(plan.ttft_budget_ms),
              PREDICTED_P50_MS: _ms(plan.predicted.ttft_p50_ms),
              PREDICTED_P95_MS: _ms(plan.predicted.ttft_p95_ms)}
    return {name: value for name, value in values.items() if value}


def answer_headers(summary: Answer) -> dict[str, str]:
    """The headers of a finished answer: :func:`plan_headers` and the measured TTFT (ms)."""
    headers = plan_headers(summary)
    measured = _ms(summary.timings.ttft_ms)
    if measured is not None:
        headers[TTFT_MS] = measured
    return headers


def response_id(receipt_id: str | None) -> str:
    """The OpenAI ``chat.completion`` id: ``chatcmpl-<receipt id>``, or ``chatcmpl-<uuid4 hex>``
    when the answer has no receipt id yet (its journal row could not be written)."""
    return CHAT_ID_PREFIX + (receipt_id or uuid.uuid4().hex)
