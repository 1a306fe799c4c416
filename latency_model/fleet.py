"""The joint choice of engine and k over a fleet of engines (pure: no I/O, no clocks).

Each engine has its own fitted profile (prefill p50/p95 band), its own predicted wait
before a new request would start prefill there (its queue and, where the engine
exposes them, its own load signals), and what it already caches of this prompt. For
every healthy engine :func:`choose` runs the single-engine planner
(:func:`latency_model.planner.plan`) with that engine's wait added to the overhead,
then picks the engine whose plan carries the most context within the budget:

1. the largest chosen ``k``;
2. ties: the lower predicted p95 TTFT (wait + prefill) of that ``k``;
3. then fewer requests in flight there;
4. then the engine's position in the configured list (deterministic).

Nothing fits anywhere (no engine makes ``k = 0`` within the budget): the choice
carries the plan of the engine that comes closest (the smallest budget at which it
would fit ``k = 0``; its ``chosen_k`` is None, binding ``nothing_fits``), with
``fits`` False, and the shortest predicted wait (a client's Retry-After). One
engine configured is the single-engine planner exactly (the answer pipeline plans
through this function). The idea of routing on a
per-request SLO from each server's predicted TTFT is llm-d's predicted-latency
scheduling; what is added here is choosing how much context to send, per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from foundation.errors import InvalidInput
from latency_model.planner import Plan, PrefillBand, plan


@dataclass(frozen=True)
class EngineView:
    """What the fleet planner knows of one engine when a request arrives.

    ``predicted_wait_ms``: expected time before a new request starts prefill there
    (ms, >= 0). ``scaffold_cached``: the engine's prefix cache holds this prompt's
    scaffold. ``cached_tokens``: per ``k = 0..K``, the tokens of that ``k``'s prompt its prefix
    cache holds (an engine that can say: the local engine), which overrides ``scaffold_cached``
    (:func:`latency_model.planner.plan`); None: the scaffold alone. ``in_flight``: requests
    running or waiting there (tie-break only).
    """

    engine_id: str
    profile: PrefillBand
    predicted_wait_ms: float
    context_window: int
    scaffold_cached: bool = False
    in_flight: int = 0
    healthy: bool = True
    cached_tokens: tuple[int, ...] | None = None


@dataclass(frozen=True)
class EnginePrediction:
    """One engine's plan for the request: its chosen ``k`` and TTFT band at the fleet's ``k``."""

    engine_id: str
    chosen_k: int | None
    predicted_wait_ms: float
    ttft_p50_ms: float | None  # wait + prefill at the fleet's chosen k (None: k beyond its rows)
    ttft_p95_ms: float | None
    binding: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the fields."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class FleetChoice:
    """The engine and plan chosen, and every healthy engine's prediction.

    ``fits`` False: nothing fits anywhere; ``engine_id``/``plan`` are then the engine
    that comes closest and its ``nothing_fits`` plan (both None when no engine is
    healthy), and ``min_feasible_budget_ms`` (None when no engine can fit the question
    at all) and ``retry_after_ms`` (the shortest predicted wait) say what would help.
    """

    engine_id: str | None
    plan: Plan | None
    fits: bool
    predictions: list[EnginePrediction] = field(default_factory=list)
    min_feasible_budget_ms: float | None = None
    retry_after_ms: float | None = None

    @property
    def chosen_k(self) -> int | None:
        """The chosen ``k``, or None when nothing fits."""
        return None if self.plan is None else self.plan.chosen_k

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: engine, k, binding, and every engine's prediction."""
        return {"engine_id": self.engine_id, "chosen_k": self.chosen_k, "fits": self.fits,
                "binding": None if self.plan is None else self.plan.binding,
                "min_feasible_budget_ms": self.min_feasible_budget_ms,
                "retry_after_ms": self.retry_after_ms,
                "predictions": [p.to_dict() for p in self.predictions]}


def choose(engines: list[EngineView], *, question_tokens: int, scaffold_tokens: int,
           chunk_tokens: list[int], budget_ms: float, max_new_tokens: int,
           overhead_ms: float = 0.0, extra_tokens: int = 0) -> FleetChoice:
    """Choose the engine and ``k`` that carry the most context within ``budget_ms`` (see module).

    Args:
        engines: the configured engines, in configuration order; unhealthy ones are skipped.
        question_tokens, scaffold_tokens, chunk_tokens, max_new_tokens, extra_tokens: as
            :func:`latency_model.planner.plan` (token counts; chunks in rank order).
        budget_ms: the request's TTFT budget, ms (finite, > 0).
        overhead_ms: time already spent before planning (auth, retrieval), ms (>= 0).

    Returns:
        A :class:`FleetChoice`; never raises because nothing fits.

    Raises:
        InvalidInput: duplicate engine ids, a negative or non-finite wait, or what
            :func:`latency_model.planner.plan` refuses.
    """
    ids = [e.engine_id for e in engines]
    if len(set(ids)) != len(ids):
        raise InvalidInput(f"engine ids must be unique, got {ids}", field="engines")
    plans: list[tuple[int, EngineView, Plan]] = []
    for order, e in enumerate(engines):
        if not math.isfinite(e.predicted_wait_ms) or e.predicted_wait_ms < 0:
            raise InvalidInput(f"engine {e.engine_id}: predicted_wait_ms must be finite and >= 0",
                               field="predicted_wait_ms")
        if not e.healthy:
            continue
        p = plan(question_tokens=question_tokens, scaffold_tokens=scaffold_tokens,
                 scaffold_cached=e.scaffold_cached, chunk_tokens=chunk_tokens, budget_ms=budget_ms,
                 profile=e.profile, max_new_tokens=max_new_tokens, context_window=e.context_window,
                 overhead_ms=overhead_ms + e.predicted_wait_ms, extra_tokens=extra_tokens,
                 cached_tokens=e.cached_tokens)
        plans.append((order, e, p))

    def rank(item: tuple[int, EngineView, Plan]) -> tuple[int, float, int, int]:
        order, e, p = item
        row = p.chosen
        assert row is not None
        return (-int(row.k), e.predicted_wait_ms + row.ttft_p95_ms, e.in_flight, order)

    feasible = [item for item in plans if item[2].chosen_k is not None]
    best = min(feasible, key=rank) if feasible else None
    fleet_k = None if best is None else best[2].chosen_k

    predictions = []
    for _order, e, p in plans:
        row = p.rows[fleet_k] if fleet_k is not None and fleet_k < len(p.rows) else None
        predictions.append(EnginePrediction(
            engine_id=e.engine_id, chosen_k=p.chosen_k, predicted_wait_ms=e.predicted_wait_ms,
            ttft_p50_ms=None if row is None else e.predicted_wait_ms + row.ttft_p50_ms,
            ttft_p95_ms=None if row is None else e.predicted_wait_ms + row.ttft_p95_ms,
            binding=p.binding))
    if best is not None:
        return FleetChoice(engine_id=best[1].engine_id, plan=best[2], fits=True, predictions=predictions)
    if not plans:
        return FleetChoice(engine_id=None, plan=None, fits=False)

    def closeness(item: tuple[int, EngineView, Plan]) -> tuple[float, int]:
        budget = item[2].min_feasible_budget_ms
        return (math.inf if budget is None else budget, item[0])

    _order, nearest, nearest_plan = min(plans, key=closeness)
    return FleetChoice(engine_id=nearest.engine_id, plan=nearest_plan, fits=False, predictions=predictions,
                       min_feasible_budget_ms=nearest_plan.min_feasible_budget_ms,
                       retry_after_ms=min(e.predicted_wait_ms for _o, e, _p in plans))
