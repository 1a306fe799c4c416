"""An answer granted the model leaves the requests that arrived meanwhile room to answer.

The engine prefills answers in the order they were granted, so the first of several
requests arriving together, bound alone, could take every chunk its budget allows and
leave the others behind it too little time to answer even with k = 0. Checked on the
step-model profile of :mod:`tests.app.test_batched_planning` (fake step timer, no model):
the cap is the largest k at which the arrival's k = 0 prefill, priced behind it, fits
the arrival's budget; arrivals nothing can save, and the answer's own arrival, do not count.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from generation.engine.messages import Prefilling
from latency_model.calibration import calibrate
from latency_model.grid import quick_grid
from latency_model.planner import BINDINGS, Plan
from latency_model.planner import plan as make_plan
from latency_model.profile import Profile
from tests.app.test_batched_planning import FakeEngine, ahead, pipeline
from tests.latency_model.conftest import no_cpu_probe
from tests.latency_model.test_step_model import FakeStepTimer

SCAFFOLD, QUESTION, CHUNK, MAX_NEW = 83, 30, 130, 32


@pytest.fixture(scope="module")
def step_profile() -> Profile:
    return calibrate(FakeStepTimer(noise=0.01), grid=quick_grid(2048, [83], 256), seed=5,
                     progress=False, cpu_probe=no_cpu_probe)


def _plan(profile: Any, budget_ms: float, spent_ms: float = 0.0) -> Plan:
    return make_plan(question_tokens=QUESTION, scaffold_tokens=SCAFFOLD, scaffold_cached=True,
                     chunk_tokens=[CHUNK] * 16, budget_ms=budget_ms, profile=profile,
                     max_new_tokens=MAX_NEW, context_window=8192, overhead_ms=spent_ms)


def _prepared(profile: Profile) -> Any:
    return SimpleNamespace(full_prompt=SimpleNamespace(scaffold_len=SCAFFOLD), profile=profile,
                           max_new_tokens=MAX_NEW)


def _k0_behind(pipe: Any, profile: Profile, plan: Plan, k: int) -> float:
    """p95 ms of an arrival's k = 0 prefill behind this answer's prompt at ``k``."""
    row, row0 = plan.rows[k], plan.rows[0]
    band = pipe.bands.behind(profile)([Prefilling(row.computed_tokens, row.cached_tokens, MAX_NEW)])
    return float(band.predict_ttft_many([row0.prompt_tokens], [row0.cached_tokens], [SCAFFOLD])[1][0])


def test_the_first_of_two_arrivals_leaves_the_second_room(step_profile: Profile) -> None:
    pipe = pipeline(FakeEngine([], []), online_correction=False)
    budget = 1.6 * float(_plan(step_profile, 1e6).rows[6].ttft_p95_ms)
    greedy = _plan(step_profile, budget)
    assert greedy.chosen_k is not None and greedy.chosen_k >= 6
    now = time.perf_counter()
    own = pipe.arrivals.arrive(now, budget, MAX_NEW)
    other = pipe.arrivals.arrive(now, budget, MAX_NEW)
    shared = pipe.arrivals.room(greedy, _prepared(step_profile), 0.0, now, own, pipe.bands)
    k = shared.chosen_k
    assert k is not None and 0 < k < greedy.chosen_k
    assert shared.binding == "arrivals" and "arrivals" in BINDINGS
    # The largest such k: the second arrival fits behind k and not behind k + 1.
    assert _k0_behind(pipe, step_profile, greedy, k) <= budget
    assert _k0_behind(pipe, step_profile, greedy, k + 1) > budget
    assert shared.rows == greedy.rows  # the table is the answer's own; only the choice moves
    # Once the other request has left (granted, refused or failed), nothing holds the plan back.
    pipe.arrivals.left(other)
    assert pipe.arrivals.room(greedy, _prepared(step_profile), 0.0, now, own, pipe.bands) is greedy
    pipe.arrivals.left(own)
    assert pipe.arrivals.waiting() == []


def test_more_arrivals_leave_no_larger_k(step_profile: Profile) -> None:
    pipe = pipeline(FakeEngine([], []), online_correction=False)
    budget = 2.0 * float(_plan(step_profile, 1e6).rows[8].ttft_p95_ms)
    greedy = _plan(step_profile, budget)
    now = time.perf_counter()
    ks = []
    for n in (1, 2, 3):
        keys = [pipe.arrivals.arrive(now, budget, MAX_NEW) for _ in range(n)]
        ks.append(pipe.arrivals.room(greedy, _prepared(step_profile), 0.0, now, None, pipe.bands).chosen_k)
        for key in keys:
            pipe.arrivals.left(key)
    assert ks[0] is not None and greedy.chosen_k is not None
    assert greedy.chosen_k > ks[0] >= ks[1] >= ks[2]  # type: ignore[operator]


def test_an_arrival_nothing_can_save_does_not_count(step_profile: Profile) -> None:
    """One whose budget is already spent would miss even behind k = 0: the plan is unchanged."""
    pipe = pipeline(FakeEngine([], []), online_correction=False)
    budget = 1.6 * float(_plan(step_profile, 1e6).rows[6].ttft_p95_ms)
    greedy = _plan(step_profile, budget)
    now = time.perf_counter()
    pipe.arrivals.arrive(now - budget / 1000.0, budget, MAX_NEW)
    assert pipe.arrivals.room(greedy, _prepared(step_profile), 0.0, now, None, pipe.bands) is greedy


def test_without_a_step_model_the_plan_is_unchanged(step_profile: Profile) -> None:
    body = step_profile.to_dict()
    body.pop("step_model")
    plain = Profile.create(**body)
    pipe = pipeline(FakeEngine([], []), online_correction=False)
    budget = 1.6 * float(_plan(plain, 1e6).rows[6].ttft_p95_ms)
    greedy = _plan(plain, budget)
    now = time.perf_counter()
    pipe.arrivals.arrive(now, budget, MAX_NEW)
    assert pipe.arrivals.room(greedy, _prepared(plain), 0.0, now, None, pipe.bands) is greedy


def test_under_the_correction_the_arrival_is_priced_behind_the_batch_and_the_answer(
        step_profile: Profile) -> None:
    from latency_model.correction import CorrectedProfile
    from latency_model.step_model import BatchedBand

    pipe = pipeline(FakeEngine([(400, 10)], [(300, 83, 16)]))
    band = pipe.bands.behind(step_profile)([Prefilling(500, SCAFFOLD, MAX_NEW)])
    assert isinstance(band, CorrectedProfile) and isinstance(band.profile, BatchedBand)
    assert ahead(band.profile) == [(300, 83, 16), (500, SCAFFOLD, MAX_NEW)]
