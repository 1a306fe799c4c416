"""OpenAI ``GET /v1/models`` and ``GET /v1/models/{id}``: the generator behind the chat route.

Front ends that speak OpenAI (chat UIs, LangChain, LlamaIndex) list models
before they send a completion. ragbudget serves one generator under two ids:
``ragbudget`` (an alias that stays valid whichever model is configured) and the
generator's own model id (``RAGBUDGET_GENERATOR_PATH`` or the packaged model's
id, or ``RAGBUDGET_REMOTE_MODEL``). Each entry is an OpenAI model object
(``id``, ``object: "model"``, ``created``, ``owned_by``) plus a ``ragbudget``
object describing the generator: backend, model id, weights hash, dtype,
device, context window, tokenizer. ``POST /v1/chat/completions`` accepts
exactly these ids as ``model``; any other is 404 ``model_not_found``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from app.api.deps import get_services, require_role
from app.services import Services
from foundation.errors import UnknownModel

router = APIRouter(tags=["openai"], dependencies=[Depends(require_role("copilot"))])

#: The id that always names the configured generator.
ALIAS = "ragbudget"
#: ``created`` of every model entry: when this server process started (unix seconds).
STARTED = int(time.time())
GENERATOR_FIELDS = ("backend", "model_id", "weights_hash", "dtype", "precision", "device", "device_name",
                    "context_window", "tokenizer_id")


class GeneratorInfo(BaseModel):
    """What answers a chat completion: the generator's identity (as recorded in receipts)."""

    backend: str = Field(description="local (transformers) or remote (OpenAI-compatible server)")
    model_id: str
    weights_hash: str | None = None
    dtype: str | None = None
    precision: str | None = Field(None, description="local engine: compute precision of the linear "
                                  "layers, fp32, bf16-tile<T> or int8-w8a8 (docs/precision.md)")
    device: str | None = None
    device_name: str | None = None
    context_window: int | None = Field(None, description="maximum prompt + output tokens")
    tokenizer_id: str | None = None


class ModelPublic(BaseModel):
    """An OpenAI model object with ragbudget's description of the generator."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="when this server process started, unix seconds")
    owned_by: str = "ragbudget"
    ragbudget: GeneratorInfo


class ModelList(BaseModel):
    """OpenAI ``GET /v1/models`` response."""

    object: Literal["list"] = "list"
    data: list[ModelPublic]


def served_model_ids(services: Services) -> list[str]:
    """The ids ``model`` may take: the alias, then the generator's model id (loads the generator)."""
    model_id = str(services.generator.identity.get("model_id") or ALIAS)
    return [ALIAS] if model_id == ALIAS else [ALIAS, model_id]


def check_model(services: Services, model: str) -> None:
    """Raises UnknownModel (404 ``model_not_found``, ``param: "model"``) for an id not served here."""
    served = served_model_ids(services)
    if model not in served:
        raise UnknownModel(f"the model {model!r} does not exist here; served: {', '.join(served)}",
                           param="model", served=served)


def _card(services: Services, model_id: str) -> ModelPublic:
    ident: dict[str, Any] = dict(services.generator.identity)
    info = GeneratorInfo.model_validate({k: ident[k] for k in GENERATOR_FIELDS if ident.get(k) is not None})
    return ModelPublic(id=model_id, created=STARTED, ragbudget=info)


@router.get("/v1/models", response_model=ModelList)
def list_models(services: Services = Depends(get_services)) -> ModelList:
    """The models ``POST /v1/chat/completions`` serves (one generator, two ids; module docstring)."""
    return ModelList(data=[_card(services, m) for m in served_model_ids(services)])


@router.get("/v1/models/{model_id:path}", response_model=ModelPublic)
def get_model(model_id: str, services: Services = Depends(get_services)) -> ModelPublic:
    """One served model. Errors: 404 ``model_not_found`` (OpenAI's error shape, ``param: "model"``)."""
    check_model(services, model_id)
    return _card(services, model_id)
