"""OpenAI-compatible ``POST /v1/chat/completions`` answered by the RAG pipeline.

Follows the OpenAI Chat Completions wire format (stream and non-stream,
``stream_options.include_usage``) so the official ``openai`` client, LangChain's
``ChatOpenAI`` and LlamaIndex's ``OpenAILike`` work unmodified. Every request
field is honoured or refused with 400 in OpenAI's error shape
(:mod:`app.api.chat_request`); ``model`` is one of ``GET /v1/models``.

The last message is the question; the system messages and earlier turns go into
the prompt after the cached scaffold (:mod:`app.prompting.conversation`), and retrieval
embeds the question with the earlier user messages. ``stop`` ends the answer at
the first stop string in the decoded text (not returned; ``finish_reason``
``"stop"``). Extras: the TTFT budget as body field ``ttft_budget_ms`` or header
``X-TTFT-Budget-Ms`` (default: settings). The answer's receipt id is its response id
(``chatcmpl-<receipt id>``, on every chunk), the ``X-Ragbudget-Receipt-Id`` header
(streamed or not) and the ``receipt_id`` of the ``ragbudget`` field of the response / final
chunk; the other headers carry the plan (chosen k, binding, predicted TTFT;
:mod:`app.api.answer_headers`), the ``ragbudget`` field the measured timings as well.

vLLM's extension ``stream_options.continuous_usage_stats`` (with ``include_usage``, as vLLM)
puts ``usage`` on every chunk: the prompt tokens and the completion tokens streamed so far
(tokens the engine produced; the final usage chunk has the exact count and the cached tokens).
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Header, Request, Response
from pydantic import BaseModel, Field

from app.answering.pipeline import AnswerPipeline
from app.answering.state import AnswerEvent, AnswerRequest
from app.answering.types import Answer, AnswerTimings, Citation, PredictedTTFT
from app.api.answer_headers import answer_headers, plan_headers, response_id
from app.api.chat_request import ChatCompletionCreate, ChatRequest, to_chat_request
from app.api.clock import arrival_of, auth_ms_of
from app.api.deps import require_role
from app.api.routes_answer import SSE_RESPONSE, get_pipeline
from app.api.routes_models import check_model
from app.api.streaming import event_stream, final_summary, iterate_in_thread, openai_sse, sse
from foundation.errors import ContextLengthExceeded, InvalidInput

router = APIRouter(tags=["openai"])


class PromptTokensDetails(BaseModel):
    """OpenAI ``usage.prompt_tokens_details``."""

    cached_tokens: int = Field(description="prompt tokens served from the prefix KV cache")


class Usage(BaseModel):
    """OpenAI ``usage``: token counts of the prompt and the completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    """The answer as an OpenAI assistant message."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """The one choice of a non-streamed completion."""

    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class RagbudgetExtra(BaseModel):
    """ragbudget's own fields on an OpenAI response: receipt id, plan choice, prediction, timings.

    ``receipt_status`` (``written``, ``pending`` or ``failed``) and ``receipt_error`` say what
    became of the receipt, as on ``POST /v1/answer`` (:class:`app.answering.types.Answer`).
    """

    receipt_id: str | None
    receipt_status: Literal["written", "pending", "failed"]
    receipt_error: str | None = None
    chosen_k: int
    binding: str
    predicted: PredictedTTFT
    timings: AnswerTimings
    citations: list[Citation]
    status: str
    revision: int
    ttft_budget_ms: float


class ChatCompletion(BaseModel):
    """A non-streamed OpenAI ``chat.completion`` with the ``ragbudget`` extra field."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(description="Unix time, seconds")
    model: str
    choices: list[ChatChoice]
    usage: Usage
    ragbudget: RagbudgetExtra


def _usage(summary: Answer) -> Usage:
    tok = summary.tokens
    return Usage(prompt_tokens=tok.prompt, completion_tokens=tok.output,
                 total_tokens=tok.prompt + tok.output,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=tok.cached))


def _extra(summary: Answer) -> RagbudgetExtra:
    return RagbudgetExtra.model_validate(summary.model_dump(include=set(RagbudgetExtra.model_fields)))


def _finish_reason(summary: Answer) -> Literal["stop", "length"]:
    """OpenAI's ``finish_reason``: ``length`` when the token limit ended the answer, else ``stop`` (a
    stop string, the end of sequence; also a cancelled or failed answer, which has no OpenAI reason)."""
    return "length" if summary.finish_reason == "length" else "stop"


#: What ``POST /v1/completions`` shares with this route (:mod:`app.api.routes_completions`).
usage_of, extra_of, finish_reason_of = _usage, _extra, _finish_reason


async def start_answer(chat: ChatRequest, request: Request, pipeline: AnswerPipeline,
                       x_ttft_budget_ms: float | None, x_on_budget_miss: str | None,
                       prompt_param: str) -> tuple[AnswerEvent, AsyncIterator[AnswerEvent]]:
    """Start answering ``chat`` in a worker thread: ``(first event, the events after it)``.

    The TTFT budget and ``on_budget_miss`` come from the body, else from the headers
    ``X-TTFT-Budget-Ms`` / ``X-Ragbudget-On-Budget-Miss``. Every refusal raises here, before
    any token: a :class:`ContextLengthExceeded` gets OpenAI's ``param``, ``prompt_param``
    (``messages``; ``prompt`` on ``/v1/completions``) when the prompt alone fills the window,
    else the output-token field the client sent.

    Raises:
        UnknownModel, RagBudgetError: as the route (:func:`chat_completions`).
    """
    check_model(pipeline.services, chat.model)
    budget = chat.ttft_budget_ms if chat.ttft_budget_ms is not None else x_ttft_budget_ms
    on_miss = chat.on_budget_miss if chat.on_budget_miss is not None else x_on_budget_miss
    req = AnswerRequest(question=chat.question, ttft_budget_ms=budget, max_new_tokens=chat.max_new_tokens,
                        on_budget_miss=on_miss,
                        revision=chat.revision, temperature=chat.temperature, top_p=chat.top_p,
                        seed=chat.seed, history=chat.history, stop=chat.stop, user=chat.user,
                        question_name=chat.question_name, ignore_eos=chat.ignore_eos,
                        min_tokens=chat.min_tokens)
    arrival, auth_ms = arrival_of(request), auth_ms_of(request)
    cancel = threading.Event()
    events = iterate_in_thread(lambda: pipeline.stream(req, cancel=cancel, arrival_t=arrival,
                                                       auth_ms=auth_ms),
                               cancel, request)
    try:
        first: AnswerEvent = await events.__anext__()
    except ContextLengthExceeded as exc:
        # OpenAI's param names the field the client sent; ``field`` is /v1/answer's name for it.
        exc.details["param"] = (prompt_param if exc.details.pop("field", None) == "question"
                                else chat.max_tokens_param)
        raise
    except InvalidInput as exc:
        if exc.code != "invalid_max_new_tokens":
            raise
        limit = exc.details.get("limit")
        exc.details.pop("field", None)
        exc.details["param"] = chat.max_tokens_param
        exc.message = (f"{chat.max_tokens_param} must be in [1, {limit}] on this server, "
                       f"got {chat.max_new_tokens}")
        raise
    return first, events


@router.post("/v1/chat/completions", dependencies=[Depends(require_role("copilot"))],
             response_model=ChatCompletion, responses=SSE_RESPONSE)
async def chat_completions(body: ChatCompletionCreate, request: Request, response: Response,
                           x_ttft_budget_ms: float | None = Header(None),
                           x_ragbudget_on_budget_miss: str | None = Header(
                               None, description="answer or reject (the body field wins)"),
                           pipeline: AnswerPipeline = Depends(get_pipeline)) -> Any:
    """OpenAI chat completion answered by the RAG pipeline (see the module docstring).

    Errors (OpenAI's shape, ``param`` naming the field): 400 ``unsupported_parameter``
    (``n`` > 1, tools, a response format other than text, logprobs, image or audio
    parts, tool roles, unknown fields), 400 ``invalid_message`` / ``invalid_stop`` /
    ``last_message_not_user`` / ``empty_question`` / ``invalid_budget`` / ...,
    400 ``context_length_exceeded`` (``param`` ``messages``: the conversation alone fills the
    model's context window; ``max_tokens`` / ``max_completion_tokens``: the output tokens asked
    for do not fit beside it; refused before queueing, never cut short),
    404 ``model_not_found``, 413 ``question_too_long``, 429 ``busy``, 503 ``budget_unreachable``
    (``on_budget_miss: reject``, or the header ``X-Ragbudget-On-Budget-Miss: reject``, and even
    k = 0 is predicted over budget; ``Retry-After``; no receipt).
    """
    chat = to_chat_request(body)
    created = int(time.time())
    # Refusals raise here -> 4xx; else the answer has the model (admitted) or left the queue.
    first, events = await start_answer(chat, request, pipeline, x_ttft_budget_ms,
                                       x_ragbudget_on_budget_miss, prompt_param="messages")

    if not chat.stream:
        s = await final_summary(first, events)
        response.headers.update(answer_headers(s))
        return ChatCompletion(
            id=response_id(s.receipt_id), created=created, model=chat.model,
            choices=[ChatChoice(message=AssistantMessage(content=s.text),
                                finish_reason=_finish_reason(s))],
            usage=_usage(s), ragbudget=_extra(s))

    plan = first.admission or first.summary  # a summary only when it left the queue unanswered
    cid = response_id(plan.receipt_id if plan is not None else None)
    prompt_tokens = (first.admission.prompt_tokens if first.admission is not None
                     else first.summary.tokens.prompt if first.summary is not None else 0)
    include_usage, continuous = chat.include_usage, chat.continuous_usage

    def running_usage(completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None,
              **extra: Any) -> bytes:
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": chat.model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        if continuous and usage is not None:
            obj["usage"] = usage
        obj.update(extra)
        return sse(obj)

    def end(s: Answer) -> list[bytes]:
        usage = _usage(s).model_dump(mode="json")
        out = [chunk({}, _finish_reason(s), usage=usage, ragbudget=_extra(s).model_dump(mode="json"))]
        if include_usage:
            out.append(sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                            "model": chat.model, "choices": [], "usage": usage}))
        return out

    async def gen() -> AsyncIterator[bytes]:
        yield chunk({"role": "assistant", "content": ""}, usage=running_usage(0))
        async for part in openai_sse(first, events, end=end,
                                     token=lambda ev: chunk({"content": ev.text},
                                                            usage=running_usage(ev.tokens))):
            yield part

    return event_stream(gen(), plan_headers(plan) if plan is not None else {})
