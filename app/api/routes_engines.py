"""``GET /v1/engines``: the engines this replica answers over, and where each stands now.

For operators (role ``operator`` and up): one object per configured engine
(``RAGBUDGET_ENGINES``; one engine, id ``default``, when none is configured), in the order
they are configured: whether it is in rotation and why not, its generation queue, its
predicted wait and the load other clients put on it (read from its ``/slots`` and ``/metrics``
in the background: :mod:`generation.remote_load`). What this replica sees: another replica
keeps its own queues and health (docs/deployment.md). Reading it costs no network call.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from app.api.deps import require_role

router = APIRouter(tags=["engines"], dependencies=[Depends(require_role("operator"))])


class EngineStatus(BaseModel):
    """One engine as this replica sees it now (:meth:`app.fleet.FleetEngine.status`)."""

    id: str = Field(description="the engine's configured id (receipts record it as plan.engine_id)")
    kind: str = Field(description="local (this process's engine) or remote (an OpenAI-compatible server)")
    base_url: str | None = Field(description="a remote engine's API root; null for the local engine")
    healthy: bool = Field(description="in rotation: answers are planned on it")
    down_reason: str | None = Field(description="why it is out of rotation (null while in rotation)")
    slots: int = Field(description="answers it runs at once (its generation queue's places)")
    queue_depth: int = Field(description="this replica's answers waiting for one of its places")
    in_flight: int = Field(description="this replica's answers running or waiting on it")
    predicted_wait_ms: float = Field(description="how long an answer arriving now would wait for it, ms, "
                                                 "other clients' load included")
    foreign_busy: int = Field(description="work of other clients priced in that wait (busy slots and "
                                          "requests it keeps waiting, beyond this replica's own)")
    engine_busy: int | None = Field(description="requests the engine says it runs (null: not read)")
    engine_waiting: int | None = Field(description="requests the engine says it keeps waiting "
                                                   "(null: not read)")
    engine_kv_usage: float | None = Field(None, description="share of the engine's KV cache in use, "
                                          "0..1 (vLLM, SGLang /metrics; null: not read or not reported)")
    profile_id: str | None = Field(description="the latency profile its latest plan used (null before one)")


@router.get("/v1/engines", response_model=list[EngineStatus])
def list_engines(request: Request) -> list[EngineStatus]:
    """Every engine of this replica's answer pipeline with its health, queue, predicted wait and
    other clients' load (:class:`EngineStatus`), in configured order. 401/403 without an
    operator key."""
    pipeline = request.app.state.pipeline
    return [EngineStatus(**engine.status(), profile_id=engine.profile_id)
            for engine in pipeline.engines.values()]
