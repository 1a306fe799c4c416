"""The joint choice of engine and k (latency_model.fleet.choose)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import ArrayLike, NDArray

from foundation.errors import InvalidInput
from latency_model.fleet import EngineView, choose
from latency_model.planner import plan


@dataclass(frozen=True)
class LinearBand:
    """Prefill ``a + b * computed`` ms at p50, ``p95 = 1.25 * p50`` (a stand-in profile)."""

    a: float
    b: float
    id: str = "sha256:linear"
    source: str = "fitted"

    def predict_ttft_many(self, prompt_tokens: ArrayLike, cached_tokens: ArrayLike,
                          prefix_tokens: ArrayLike | None = None
                          ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        n = np.asarray(prompt_tokens, dtype=np.float64)
        c = np.asarray(cached_tokens, dtype=np.float64)
        p50 = self.a + self.b * (n - c)
        return p50, 1.25 * p50


FAST, SLOW = LinearBand(20.0, 2.0), LinearBand(40.0, 4.0)
REQUEST = {"question_tokens": 20, "scaffold_tokens": 80, "chunk_tokens": [150] * 8,
           "max_new_tokens": 32}


def engine(name: str, band: LinearBand, wait: float = 0.0, **kw: object) -> EngineView:
    return EngineView(name, band, wait, context_window=4096, **kw)  # type: ignore[arg-type]


def test_the_engine_that_fits_the_most_context_wins_not_the_first_or_the_idlest() -> None:
    # The slow engine is idle; the fast one has a queue, yet fits more chunks after its wait.
    fleet = [engine("slow", SLOW), engine("fast", FAST, wait=300.0)]
    got = choose(fleet, budget_ms=2000.0, **REQUEST)  # type: ignore[arg-type]
    alone = {e.engine_id: plan(**REQUEST, scaffold_cached=False, budget_ms=2000.0,  # type: ignore[arg-type]
                               profile=e.profile, context_window=4096,
                               overhead_ms=e.predicted_wait_ms).chosen_k for e in fleet}
    assert got.engine_id == "fast" and got.chosen_k == alone["fast"] > alone["slow"]
    assert {p.engine_id for p in got.predictions} == {"slow", "fast"}
    fast = next(p for p in got.predictions if p.engine_id == "fast")
    assert fast.ttft_p95_ms is not None and fast.ttft_p95_ms <= 2000.0


def test_ties_go_to_the_lower_p95_then_fewer_in_flight_then_configuration_order() -> None:
    a, b = engine("a", FAST, wait=100.0), engine("b", FAST, wait=50.0)
    assert choose([a, b], budget_ms=5000.0, **REQUEST).engine_id == "b"  # type: ignore[arg-type]
    a, b = engine("a", FAST, in_flight=3), engine("b", FAST, in_flight=1)
    assert choose([a, b], budget_ms=5000.0, **REQUEST).engine_id == "b"  # type: ignore[arg-type]
    a, b = engine("a", FAST), engine("b", FAST)
    assert choose([a, b], budget_ms=5000.0, **REQUEST).engine_id == "a"  # type: ignore[arg-type]


def test_a_cached_scaffold_and_health_count() -> None:
    warm = engine("warm", FAST, scaffold_cached=True)
    cold = engine("cold", FAST)
    got = choose([cold, warm], budget_ms=5000.0, **REQUEST)  # type: ignore[arg-type]
    assert got.engine_id == "warm"  # same k (all 8), lower p95: 80 tokens fewer to compute
    down = engine("fast", FAST, healthy=False)
    got = choose([down, engine("slow", SLOW)], budget_ms=5000.0, **REQUEST)  # type: ignore[arg-type]
    assert got.engine_id == "slow" and [p.engine_id for p in got.predictions] == ["slow"]


def test_nothing_fits_anywhere_says_the_least_budget_and_the_shortest_wait() -> None:
    fleet = [engine("a", FAST, wait=900.0), engine("b", SLOW, wait=400.0)]
    got = choose(fleet, budget_ms=300.0, **REQUEST)  # type: ignore[arg-type]
    assert not got.fits and got.chosen_k is None
    k0 = {"a": 900.0 + 1.25 * (20 + 2 * 100), "b": 400.0 + 1.25 * (40 + 4 * 100)}
    assert got.min_feasible_budget_ms == pytest.approx(min(k0.values()))
    assert got.engine_id == min(k0, key=k0.__getitem__)  # the closest engine's nothing_fits plan
    assert got.plan is not None and got.plan.binding == "nothing_fits"
    assert got.retry_after_ms == 400.0
    none = choose([engine("a", FAST, healthy=False)], budget_ms=300.0, **REQUEST)  # type: ignore[arg-type]
    assert none.engine_id is None and none.plan is None and not none.fits


def test_one_engine_is_the_single_engine_planner_exactly() -> None:
    for budget in (150.0, 700.0, 1500.0, 9000.0):
        for cached in (False, True):
            alone = plan(**REQUEST, scaffold_cached=cached, budget_ms=budget, profile=FAST,  # type: ignore[arg-type]
                         context_window=4096, overhead_ms=35.0)
            got = choose([engine("only", FAST, scaffold_cached=cached)], budget_ms=budget,
                         overhead_ms=35.0, **REQUEST)  # type: ignore[arg-type]
            assert got.plan == alone and got.engine_id == "only"


def test_bad_fleets_are_refused() -> None:
    with pytest.raises(InvalidInput):
        choose([engine("a", FAST), engine("a", SLOW)], budget_ms=1000.0, **REQUEST)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        choose([engine("a", FAST, wait=float("nan"))], budget_ms=1000.0, **REQUEST)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(waits=st.lists(st.floats(0, 3000), min_size=1, max_size=6),
       speeds=st.lists(st.floats(0.5, 4.0), min_size=6, max_size=6),
       budget=st.floats(100, 6000))
def test_no_engine_alone_carries_more_context_than_the_fleet_choice(
        waits: list[float], speeds: list[float], budget: float) -> None:
    fleet = [engine(f"e{i}", LinearBand(10.0 * s, 1.5 * s), wait=w)
             for i, (w, s) in enumerate(zip(waits, speeds, strict=False))]
    got = choose(fleet, budget_ms=budget, **REQUEST)  # type: ignore[arg-type]
    best_alone = max((plan(**REQUEST, scaffold_cached=False, budget_ms=budget,  # type: ignore[arg-type]
                           profile=e.profile, context_window=4096,
                           overhead_ms=e.predicted_wait_ms).chosen_k for e in fleet),
                     key=lambda k: -1 if k is None else k)
    assert got.chosen_k == best_alone
    if got.fits:
        assert got.plan is not None
        chosen = got.plan.chosen
        assert chosen is not None and chosen.fits_budget
