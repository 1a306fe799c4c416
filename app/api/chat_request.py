"""The OpenAI chat completion request: every field is honoured or refused, none is ignored.

``POST /v1/chat/completions`` (:mod:`app.api.routes_chat`) reads its body
through :class:`ChatCompletionCreate` and :func:`to_chat_request`. Each field
of OpenAI's Chat Completions request falls in one of three groups:

* honoured: ``model`` (one of ``GET /v1/models``), ``messages`` (roles
  system, developer, user, assistant; content a string or a list of text
  parts, joined by newlines as vLLM does; ``name`` recorded in the receipt, not shown
  to the model), ``stream``, ``stream_options``
  (``include_usage``; vLLM's ``continuous_usage_stats``: usage on every chunk),
  ``max_tokens`` / ``max_completion_tokens``,
  ``temperature``, ``top_p``, ``seed`` (0 .. 2**53 - 1), ``stop`` (a string or
  up to 4), ``user`` (recorded in the receipt), vLLM's ``ignore_eos`` and
  ``min_tokens`` (what LLM benchmark clients send; recorded in the receipt's generation
  parameters and replayed), and ragbudget's own
  ``ttft_budget_ms``, ``revision`` and ``on_budget_miss`` (``answer`` or
  ``reject``; also the header ``X-Ragbudget-On-Budget-Miss``, the body wins);
* accepted only with the value that changes nothing (:data:`NEUTRAL`): ``n``
  1, penalties 0, ``logprobs`` false, ``response_format`` ``{"type": "text"}``,
  ``tool_choice`` ``"none"``, ``tools`` ``[]``, ``modalities`` ``["text"]``,
  ... (null is always accepted);
* everything else, including any other value of those: refused with 400
  ``unsupported_parameter`` naming the field in ``param`` (OpenAI's error
  shape, :mod:`app.api.errors`). Image, audio and file content parts, tool
  messages and tool calls are refused the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.api.routes_answer import MAX_REVISION
from app.prompting.conversation import SYSTEM_ROLES, TURN_ROLES, Turn
from foundation.errors import InvalidInput, UnsupportedParameter
from generation.base import MAX_SEED
from generation.stopping import normalize_stop

MAX_USER_CHARS = 512

#: OpenAI request fields accepted only with these values (or null): each value does nothing.
NEUTRAL: dict[str, list[Any]] = {
    "n": [1],
    "frequency_penalty": [0],
    "presence_penalty": [0],
    "logprobs": [False],
    "top_logprobs": [0],
    "logit_bias": [{}],
    "response_format": [{"type": "text"}],
    "tools": [[]],
    "tool_choice": ["none"],
    "functions": [[]],
    "function_call": ["none"],
    "parallel_tool_calls": [False],
    "modalities": [["text"]],
    "store": [False],
    "service_tier": ["auto", "default"],
}
#: Why a non-neutral value of a field is refused (the error message).
REFUSED_BECAUSE = {
    "n": "one choice per request is supported (n = 1)",
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "response_format": "only text responses are supported",
    "logprobs": "log probabilities are not returned",
    "top_logprobs": "log probabilities are not returned",
    "modalities": "only text output is supported",
}
MESSAGE_KEYS = ("role", "content", "name")
#: The longest message ``name`` accepted (OpenAI's limit).
MAX_NAME_CHARS = 64
#: Message fields accepted only with these values (or null).
MESSAGE_NEUTRAL: dict[str, list[Any]] = {"tool_calls": [[]], "refusal": [], "audio": [],
                                         "function_call": [], "tool_call_id": []}


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a final chunk with ``usage``) and vLLM's
    ``continuous_usage_stats`` (with ``include_usage``: ``usage`` on every chunk, as vLLM)."""

    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatCompletionCreate(BaseModel):
    """OpenAI's chat completion request (see the module docstring for what each field does).

    Types are strict (no ``true`` -> 1, no ``"5"`` -> 5); fields outside this model
    are kept for :func:`to_chat_request`, which refuses them by name.
    """

    model_config = ConfigDict(extra="allow", strict=True)
    model: str = Field("ragbudget", description="a model id from GET /v1/models")
    messages: list[dict[str, Any]] = Field(..., min_length=1,
                                           description="system/developer/user/assistant messages; "
                                                       "the last one is the user's question")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 or absent: greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="0..2**53-1")
    stop: str | list[str] | None = Field(None, description="a string or up to 4 strings")
    user: str | None = Field(None, max_length=MAX_USER_CHARS, description="recorded in the receipt")
    ignore_eos: bool = Field(False, description="vLLM: go on past end-of-text until max_tokens")
    min_tokens: int = Field(0, ge=0, description="vLLM: no end-of-text before this many tokens "
                                                 "(at most max_tokens)")
    ttft_budget_ms: float | None = Field(None, description="ragbudget: TTFT budget in ms")
    revision: int | None = Field(None, ge=1, le=MAX_REVISION, description="ragbudget: corpus revision")
    on_budget_miss: Literal["answer", "reject"] | None = Field(
        None, description="ragbudget: when even k=0 cannot make the budget, answer anyway (flagged) "
        "or refuse with 503 budget_unreachable; default: the server's setting")


@dataclass
class ChatRequest:
    """A validated chat request, ready for the answer pipeline.

    ``question`` is the last (user) message's text and ``question_name`` its ``name``;
    ``history`` the messages before it; ``messages`` all of them, as recorded in the receipt.
    """

    model: str
    question: str
    question_name: str | None
    history: list[Turn]
    messages: list[Turn]
    stream: bool
    include_usage: bool
    max_new_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str] = field(default_factory=list)
    user: str | None = None
    ttft_budget_ms: float | None = None
    revision: int | None = None
    on_budget_miss: str | None = None
    continuous_usage: bool = False  # usage on every chunk (include_usage and continuous_usage_stats)
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens_param: str = "max_tokens"  # the output-token field the client sent (error param)


def _neutral(value: Any, allowed: list[Any]) -> bool:
    if value is None:
        return True
    return any(type(value) is type(ok) and value == ok
               or (isinstance(ok, int | float) and not isinstance(ok, bool)
                   and isinstance(value, int | float) and not isinstance(value, bool) and value == ok)
               for ok in allowed)


def refuse_unhonoured_fields(extra: dict[str, Any], neutral: dict[str, list[Any]] | None = None,
                             refused_because: dict[str, str] | None = None) -> None:
    """Raise for the first field of ``extra`` (fields outside the honoured set) that would change
    anything. ``neutral``/``refused_because``: the route's table and reasons (default: chat's
    :data:`NEUTRAL` and :data:`REFUSED_BECAUSE`).

    Raises:
        UnsupportedParameter: a field not in ``neutral`` (unknown to ragbudget), or one with a
            value other than its neutral ones; ``details.param`` names it.
    """
    table = NEUTRAL if neutral is None else neutral
    reasons = REFUSED_BECAUSE if refused_because is None else refused_because
    for name, value in extra.items():
        if name not in table:
            raise UnsupportedParameter(f"{name!r} is not supported by this server", param=name)
        if not _neutral(value, table[name]):
            because = reasons.get(name, f"only {table[name]!r} is accepted" if table[name]
                                  else "only null is accepted")
            raise UnsupportedParameter(f"{name}={value!r} is not supported: {because}", param=name)


def message_text(message: dict[str, Any], index: int) -> Turn:
    """One message as a :class:`Turn` (text parts joined by newlines).

    Raises:
        UnsupportedParameter: a tool/function role, a non-text content part, or a
            message field other than role, content and name (``tool_calls``, ...).
        InvalidInput (``invalid_message``): a missing or unknown role, content that is
            neither a string nor a list of parts, or a ``name`` that is not a string of 1 to
            :data:`MAX_NAME_CHARS` characters.
    """
    where = f"messages[{index}]"
    role = message.get("role")
    if role in ("tool", "function"):
        raise UnsupportedParameter(f"{where}.role {role!r} is not supported: tool calling is not "
                                   "supported", param=f"{where}.role")
    if not isinstance(role, str) or role not in SYSTEM_ROLES + TURN_ROLES:
        raise InvalidInput(f"{where}.role must be one of {', '.join(SYSTEM_ROLES + TURN_ROLES)}, "
                           f"got {role!r}", code="invalid_message", param=f"{where}.role")
    for key, value in message.items():
        if key in MESSAGE_KEYS:
            continue
        if key not in MESSAGE_NEUTRAL or not _neutral(value, MESSAGE_NEUTRAL[key]):
            raise UnsupportedParameter(f"{where}.{key} is not supported", param=f"{where}.{key}")
    name = message.get("name")
    if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS):
        raise InvalidInput(f"{where}.name must be a string of 1 to {MAX_NAME_CHARS} characters",
                           code="invalid_message", param=f"{where}.name")
    content = message.get("content")
    if isinstance(content, str):
        return Turn(role, content, name)
    if not isinstance(content, list):
        raise InvalidInput(f"{where}.content must be a string or a list of text parts",
                           code="invalid_message", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise UnsupportedParameter(f"{at}.type {kind!r} is not supported: only text parts are",
                                       param=f"{at}.type")
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise UnsupportedParameter(f"{at} must be {{\"type\": \"text\", \"text\": <string>}}",
                                       param=at)
        texts.append(part["text"])
    return Turn(role, "\n".join(texts), name)


def to_chat_request(body: ChatCompletionCreate) -> ChatRequest:
    """Validate ``body`` field by field (module docstring) and return the pipeline's view of it.

    Raises:
        UnsupportedParameter, InvalidInput: see :func:`refuse_unhonoured_fields`,
            :func:`message_text`; ``invalid_stop`` (:func:`generation.stopping.normalize_stop`);
            ``last_message_not_user``; ``stream_options`` without ``stream``;
            ``max_tokens`` and ``max_completion_tokens`` that disagree.
    """
    refuse_unhonoured_fields(dict(body.model_extra or {}))
    if body.stream_options is not None:
        if not body.stream:
            raise InvalidInput("stream_options is only allowed with stream: true",
                               code="invalid_request", param="stream_options")
        for name in body.stream_options.model_extra or {}:
            raise UnsupportedParameter(f"stream_options.{name} is not supported",
                                       param=f"stream_options.{name}")
    if (body.max_tokens is not None and body.max_completion_tokens is not None
            and body.max_tokens != body.max_completion_tokens):
        raise InvalidInput("max_tokens and max_completion_tokens disagree; send one of them",
                           code="invalid_request", param="max_tokens")
    turns = [message_text(m, i) for i, m in enumerate(body.messages)]
    if turns[-1].role != "user":
        raise InvalidInput("the last message must be the user's question (role user)",
                           code="last_message_not_user", param=f"messages[{len(turns) - 1}].role")
    return ChatRequest(
        model=body.model, question=turns[-1].content, question_name=turns[-1].name,
        history=turns[:-1], messages=turns,
        stream=body.stream, include_usage=bool(body.stream_options and body.stream_options.include_usage),
        max_new_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature or 0.0, top_p=body.top_p if body.top_p is not None else 1.0,
        seed=body.seed, stop=normalize_stop(body.stop), user=body.user,
        ttft_budget_ms=body.ttft_budget_ms, revision=body.revision, on_budget_miss=body.on_budget_miss,
        continuous_usage=bool(body.stream_options and body.stream_options.include_usage
                              and body.stream_options.continuous_usage_stats),
        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
        max_tokens_param="max_completion_tokens" if body.max_tokens is None and body.max_completion_tokens
        else "max_tokens")
