"""OpenAI-compatible legacy ``POST /v1/completions``: a prompt string answered as one user turn.

LlamaIndex's ``OpenAILike`` posts here with its defaults (``is_chat_model`` False) for
``complete()`` and, its messages formatted into one prompt, for ``chat()`` too. The prompt
goes the way of a chat request with a single user message (:mod:`app.api.routes_chat`):
retrieval, the plan for the TTFT budget, the prompt laid out after the cached scaffold, the
receipt (``request.messages`` holds the one user message). The response follows OpenAI's
legacy shape, ``object: "text_completion"`` with ``choices[0].text``, streamed or not
(``stream_options.include_usage`` as on chat), with the same ``ragbudget`` extra field.

Fields: ``prompt`` a string (or a list of one string); ``max_tokens`` (absent: the
server's default, as on chat, cut to what the context window leaves), ``temperature``,
``top_p``, ``seed``, ``stop``, ``user``, ``stream``, ``stream_options`` and ragbudget's own
``ttft_budget_ms``, ``revision``, ``on_budget_miss`` are honoured as on chat; ``n`` and
``best_of`` 1, ``echo`` false, penalties 0, ``logit_bias`` {} and null for ``suffix`` and
``logprobs`` change nothing and are accepted; anything else is refused with 400
``unsupported_parameter`` naming the field (OpenAI's error shape).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Depends, Header, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from app.answering.pipeline import AnswerPipeline
from app.answering.types import Answer
from app.api.answer_headers import answer_headers, plan_headers
from app.api.chat_request import (
    MAX_USER_CHARS,
    ChatRequest,
    StreamOptions,
    refuse_unhonoured_fields,
)
from app.api.deps import require_role
from app.api.routes_answer import MAX_REVISION, SSE_RESPONSE, get_pipeline
from app.api.routes_chat import RagbudgetExtra, Usage, extra_of, finish_reason_of, start_answer, usage_of
from app.api.streaming import event_stream, final_summary, openai_sse, sse
from app.prompting.conversation import Turn
from foundation.errors import InvalidInput, UnsupportedParameter
from generation.base import MAX_SEED
from generation.stopping import normalize_stop

router = APIRouter(tags=["openai"])

#: Legacy completion fields accepted only with these values (or null): each value does nothing.
COMPLETION_NEUTRAL: dict[str, list[Any]] = {
    "n": [1],
    "best_of": [1],
    "echo": [False],
    "suffix": [],
    "logprobs": [],
    "frequency_penalty": [0],
    "presence_penalty": [0],
    "logit_bias": [{}],
}
COMPLETION_REFUSED_BECAUSE = {
    "n": "one choice per request is supported (n = 1)",
    "best_of": "one candidate per request is generated (best_of = 1)",
    "echo": "the prompt is not echoed",
    "suffix": "insertion (suffix) is not supported",
    "logprobs": "log probabilities are not returned",
}


class CompletionCreate(BaseModel):
    """OpenAI's legacy completion request (see the module docstring for what each field does).

    Types are strict; fields outside this model are refused by name
    (:func:`app.api.chat_request.refuse_unhonoured_fields`).
    """

    model_config = ConfigDict(extra="allow", strict=True)
    model: str = Field("ragbudget", description="a model id from GET /v1/models")
    prompt: Any = Field(..., description="the question: a string, or a list of one string")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 or absent: greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="0..2**53-1")
    stop: str | list[str] | None = Field(None, description="a string or up to 4 strings")
    user: str | None = Field(None, max_length=MAX_USER_CHARS, description="recorded in the receipt")
    ttft_budget_ms: float | None = Field(None, description="ragbudget: TTFT budget in ms")
    revision: int | None = Field(None, ge=1, le=MAX_REVISION, description="ragbudget: corpus revision")
    on_budget_miss: Literal["answer", "reject"] | None = Field(
        None, description="ragbudget: when even k=0 cannot make the budget, answer anyway (flagged) "
        "or refuse with 503 budget_unreachable; default: the server's setting")


def to_completion_request(body: CompletionCreate) -> ChatRequest:
    """``body`` as the one-user-turn chat request the answer path takes.

    Raises:
        UnsupportedParameter: a field other than the honoured ones with a value that would
            change anything; a prompt of token ids or of several strings (``param`` ``prompt``).
        InvalidInput: ``stream_options`` without ``stream``; ``invalid_stop``.
    """
    refuse_unhonoured_fields(dict(body.model_extra or {}), COMPLETION_NEUTRAL, COMPLETION_REFUSED_BECAUSE)
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise UnsupportedParameter("one prompt string per request is supported", param="prompt")
    if not isinstance(prompt, str):
        raise UnsupportedParameter("prompt must be a string (token ids are not supported)", param="prompt")
    if body.stream_options is not None:
        if not body.stream:
            raise InvalidInput("stream_options is only allowed with stream: true",
                               code="invalid_request", param="stream_options")
        for name in body.stream_options.model_extra or {}:
            raise UnsupportedParameter(f"stream_options.{name} is not supported",
                                       param=f"stream_options.{name}")
    return ChatRequest(
        model=body.model, question=prompt, question_name=None, history=[],
        messages=[Turn("user", prompt)], stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        max_new_tokens=body.max_tokens, temperature=body.temperature or 0.0,
        top_p=body.top_p if body.top_p is not None else 1.0, seed=body.seed,
        stop=normalize_stop(body.stop), user=body.user, ttft_budget_ms=body.ttft_budget_ms,
        revision=body.revision, on_budget_miss=body.on_budget_miss)


class CompletionChoice(BaseModel):
    """The one choice of a non-streamed legacy completion."""

    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class TextCompletion(BaseModel):
    """A non-streamed OpenAI ``text_completion`` with the ``ragbudget`` extra field."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(description="Unix time, seconds")
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    ragbudget: RagbudgetExtra


@router.post("/v1/completions", dependencies=[Depends(require_role("copilot"))],
             response_model=TextCompletion, responses=SSE_RESPONSE)
async def completions(body: CompletionCreate, request: Request, response: Response,
                      x_ttft_budget_ms: float | None = Header(None),
                      x_ragbudget_on_budget_miss: str | None = Header(
                          None, description="answer or reject (the body field wins)"),
                      pipeline: AnswerPipeline = Depends(get_pipeline)) -> Any:
    """OpenAI legacy completion answered by the RAG pipeline (see the module docstring).

    Errors (OpenAI's shape, ``param`` naming the field): 400 ``unsupported_parameter``,
    ``context_length_exceeded`` (``param`` ``prompt``: the prompt alone fills the window;
    ``max_tokens``: the tokens asked for do not fit beside it), ``empty_question``,
    ``invalid_stop``, ...; 404 ``model_not_found``; 413 ``question_too_long``; 429 ``busy``
    (Retry-After); 503 ``budget_unreachable``; as ``POST /v1/chat/completions``.
    """
    chat = to_completion_request(body)
    created = int(time.time())
    first, events = await start_answer(chat, request, pipeline, x_ttft_budget_ms,
                                       x_ragbudget_on_budget_miss, prompt_param="prompt")
    if not chat.stream:
        s = await final_summary(first, events)
        response.headers.update(answer_headers(s))
        return TextCompletion(id=completion_id(s.receipt_id), created=created, model=chat.model,
                              choices=[CompletionChoice(text=s.text, finish_reason=finish_reason_of(s))],
                              usage=usage_of(s), ragbudget=extra_of(s))

    plan = first.admission or first.summary  # a summary only when it left the queue unanswered
    cid = completion_id(plan.receipt_id if plan is not None else None)

    def chunk(text: str, finish: str | None = None, **extra: Any) -> bytes:
        obj = {"id": cid, "object": "text_completion", "created": created, "model": chat.model,
               "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
        obj.update(extra)
        return sse(obj)

    def end(s: Answer) -> list[bytes]:
        out = [chunk("", finish_reason_of(s), ragbudget=extra_of(s).model_dump(mode="json"))]
        if chat.include_usage:
            out.append(sse({"id": cid, "object": "text_completion", "created": created,
                            "model": chat.model, "choices": [],
                            "usage": usage_of(s).model_dump(mode="json")}))
        return out

    sse_body = openai_sse(first, events, token=lambda ev: chunk(ev.text), end=end)
    return event_stream(sse_body, plan_headers(plan) if plan is not None else {})


def completion_id(receipt_id: str | None) -> str:
    """The OpenAI ``text_completion`` id: ``cmpl-<receipt id>``, or ``cmpl-<uuid4 hex>`` when the
    answer has no receipt id yet (as :func:`app.api.answer_headers.response_id` for chat)."""
    return "cmpl-" + (receipt_id or uuid.uuid4().hex)
