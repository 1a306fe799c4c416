"""``GET /metrics``: Prometheus text format (open unless ``metrics_public`` is false)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.api.deps import get_principal, get_services
from app.auth import require
from app.services import Services

router = APIRouter(tags=["metrics"])


# Not JSON: the Prometheus text exposition format (version 0.0.4), described as such in OpenAPI.
PROMETHEUS_TEXT: dict[int | str, dict[str, object]] = {
    200: {"description": "Prometheus text exposition format",
          "content": {"text/plain": {"schema": {"type": "string"}}}}}


@router.get("/metrics", response_class=Response, responses=PROMETHEUS_TEXT)
def metrics(request: Request, services: Services = Depends(get_services)) -> Response:
    """Histograms (ms) of TTFT, TPOT, queue and retrieval time; counters of answers by status,
    budget misses and prompt/cached/computed tokens; each loaded local engine's prefix KV cache
    (hits, cached tokens, evictions, bytes held and its budget), read at this request. Needs role
    operator unless ``RAGBUDGET_METRICS_PUBLIC`` is true (default)."""
    if not services.settings.metrics_public:
        require(get_principal(request, services), "operator")
    metrics = request.app.state.pipeline.metrics
    metrics.prefix_cache_state(services.prefix_cache_stats())
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
