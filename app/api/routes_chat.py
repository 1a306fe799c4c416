"""OpenAI-compatible ``POST /v1/chat/completions`` with the RAG pipeline on the last user message.

Follows the OpenAI Chat Completions wire format (stream and non-stream,
``stream_options.include_usage``) so the official ``openai`` client works
unmodified. Extras: the TTFT budget as body field ``ttft_budget_ms`` or header
``X-TTFT-Budget-Ms`` (default: settings), and the answer's receipt id in the
``ragbudget`` field of the response / final chunk and the
``X-Ragbudget-Receipt-Id`` header (non-streaming).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from app.answer_types import Answer, AnswerTimings, Citation, PredictedTTFT
from app.api.deps import require_role
from app.api.routes_answer import MAX_REVISION, SSE_RESPONSE, get_pipeline
from app.api.streaming import iterate_in_thread
from app.pipeline import AnswerEvent, AnswerPipeline, AnswerRequest
from foundation.errors import InvalidInput

router = APIRouter(tags=["openai"])


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)  # JSON types as documented: no true -> 1, no "5" -> 5
    include_usage: bool = False


class ChatCompletionCreate(BaseModel):
    """The subset of the OpenAI request ragbudget honours; unknown fields are ignored."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str = "ragbudget"
    messages: list[ChatMessage] = Field(..., min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    ttft_budget_ms: float | None = None
    revision: int | None = Field(None, ge=1, le=MAX_REVISION)


def last_user_text(messages: list[ChatMessage]) -> str:
    """The text of the last ``user`` message (text parts joined).

    Raises:
        InvalidInput (``no_user_message``): there is no user message with text.
    """
    for m in reversed(messages):
        if m.role != "user":
            continue
        if isinstance(m.content, str):
            return m.content
        if isinstance(m.content, list):
            return "".join(str(p.get("text", "")) for p in m.content if p.get("type") == "text")
    raise InvalidInput("no user message with text content", code="no_user_message")


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
    """ragbudget's own fields on an OpenAI response: receipt id, plan choice, prediction, timings."""

    receipt_id: str | None
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


def _finish_reason(summary: Answer, max_new: int) -> Literal["stop", "length"]:
    if summary.status != "ok":
        return "stop"
    return "length" if summary.tokens.output >= max_new else "stop"


@router.post("/v1/chat/completions", dependencies=[Depends(require_role("copilot"))],
             response_model=ChatCompletion, responses=SSE_RESPONSE)
async def chat_completions(body: ChatCompletionCreate, request: Request, response: Response,
                           x_ttft_budget_ms: float | None = Header(None),
                           pipeline: AnswerPipeline = Depends(get_pipeline)) -> Any:
    """OpenAI chat completion answered by the RAG pipeline (see module docstring).

    Errors: 422 (``no_user_message``, ``invalid_budget``, ...), 429 ``busy``.
    """
    arrival = time.perf_counter()
    settings = pipeline.settings
    max_new = body.max_completion_tokens or body.max_tokens or settings.default_max_new_tokens
    budget = body.ttft_budget_ms if body.ttft_budget_ms is not None else x_ttft_budget_ms
    req = AnswerRequest(question=last_user_text(body.messages), ttft_budget_ms=budget,
                        max_new_tokens=max_new, revision=body.revision,
                        temperature=body.temperature or 0.0,
                        top_p=body.top_p if body.top_p is not None else 1.0, seed=body.seed)
    cid = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    cancel = threading.Event()
    events = iterate_in_thread(lambda: pipeline.stream(req, cancel=cancel, arrival_t=arrival),
                               cancel, request)
    first: AnswerEvent = await events.__anext__()

    if not body.stream:
        final = first
        async for ev in events:
            final = ev
        s = final.summary
        assert s is not None, "the pipeline ends every stream with a summary"
        response.headers["X-Ragbudget-Receipt-Id"] = s.receipt_id or ""
        return ChatCompletion(
            id=cid, created=created, model=body.model,
            choices=[ChatChoice(message=AssistantMessage(content=s.text),
                                finish_reason=_finish_reason(s, max_new))],
            usage=_usage(s), ragbudget=_extra(s))

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": body.model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        obj.update(extra)
        return f"data: {json.dumps(obj, ensure_ascii=False, default=str)}\n\n".encode()

    async def gen() -> AsyncIterator[bytes]:
        yield chunk({"role": "assistant", "content": ""})
        ev: AnswerEvent | None = first
        try:
            while ev is not None:
                if ev.kind == "token":
                    yield chunk({"content": ev.text})
                else:
                    s = ev.summary
                    assert s is not None, "final and error events carry the summary"
                    if ev.kind == "error":
                        err_obj = s.error.model_dump() if s.error is not None else None
                        err = {"error": {"code": "generation_failed", "message": str(err_obj)}}
                        yield f"data: {json.dumps(err)}\n\n".encode()
                    yield chunk({}, _finish_reason(s, max_new),
                                ragbudget=_extra(s).model_dump(mode="json"))
                    if include_usage:
                        usage = {"id": cid, "object": "chat.completion.chunk", "created": created,
                                 "model": body.model, "choices": [],
                                 "usage": _usage(s).model_dump(mode="json")}
                        yield f"data: {json.dumps(usage)}\n\n".encode()
                ev = await anext(events, None)
        except Exception as exc:  # never a silent cut
            err = {"error": {"code": getattr(exc, "code", "internal_error"), "message": str(exc)}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
