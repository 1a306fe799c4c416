"""The planner: largest k under budget (p95 + overhead) and context window, binding reasons."""

from __future__ import annotations

import pytest

from foundation.errors import InvalidInput
from latency_model.planner import plan
from latency_model.profile import Profile

EXACT = Profile.create(
    source="fitted", created_at="2026-01-01T00:00:00+00:00", device="cpu", device_name="Fake",
    model_id="fake", weights_hash="sha256:" + "1" * 64, dtype="float32", threads=2, backend="local",
    context_window=4096, prefill_model="linear", prefill_coefficients={"a": 100.0, "b": 1.0},
    prefill_quantiles={"p05": -0.1, "p50": 0.0, "p90": 0.05, "p95": 0.1, "p99": 0.2},
    decode_model="linear_decode", decode_coefficients={"d": 20.0, "e": 0.0},
    decode_quantiles={"p50": 0.0, "p95": 0.0},
)
# With this profile: p50 = 100 + m ms, p95 = 1.1 * (100 + m) ms.


def _plan(**overrides: object):  # type: ignore[no-untyped-def]
    args: dict[str, object] = dict(question_tokens=20, scaffold_tokens=80, scaffold_cached=True,
                                   chunk_tokens=[100, 100, 100, 100], budget_ms=500.0, profile=EXACT,
                                   max_new_tokens=64, context_window=4096)
    args.update(overrides)
    return plan(**args)  # type: ignore[arg-type]


def test_rows_follow_the_prompt_layout_for_every_k() -> None:
    p = _plan(extra_tokens=5)
    assert [r.k for r in p.rows] == [0, 1, 2, 3, 4]
    assert [r.prompt_tokens for r in p.rows] == [105, 205, 305, 405, 505]
    assert all(r.cached_tokens == 80 for r in p.rows)
    assert [r.computed_tokens for r in p.rows] == [25, 125, 225, 325, 425]


def test_uncached_scaffold_is_computed() -> None:
    p = _plan(scaffold_cached=False)
    assert p.rows[0].cached_tokens == 0 and p.rows[0].computed_tokens == 100


def test_chooses_largest_k_whose_p95_plus_overhead_fits() -> None:
    # p95(k) = 1.1 * (100 + 20 + 100k): k=2 -> 352, k=3 -> 462, k=4 -> 572.
    assert _plan(budget_ms=500.0).chosen_k == 3
    assert _plan(budget_ms=500.0, overhead_ms=50.0).chosen_k == 2
    p = _plan(budget_ms=462.0 + 1e-9)
    assert p.chosen_k == 3 and p.binding == "budget"


def test_p95_not_p50_decides() -> None:
    # p50(k=3) = 420 fits 430, p95(k=3) = 462 does not.
    assert _plan(budget_ms=430.0).chosen_k == 2


def test_context_window_binds_when_the_prompt_would_not_fit() -> None:
    p = _plan(budget_ms=10_000.0, context_window=64 + 305)
    assert p.chosen_k == 2 and p.binding == "context_window"
    assert not p.rows[3].fits_context and p.rows[3].fits_budget


def test_all_candidates_fitting_is_candidates_exhausted() -> None:
    p = _plan(budget_ms=10_000.0)
    assert p.chosen_k == 4 and p.binding == "candidates_exhausted"


def test_no_candidates_is_candidates_exhausted_at_zero() -> None:
    p = _plan(chunk_tokens=[])
    assert p.chosen_k == 0 and p.binding == "candidates_exhausted" and len(p.rows) == 1


def test_k_zero_infeasible_reports_min_feasible_budget() -> None:
    p = _plan(budget_ms=50.0, overhead_ms=10.0)
    assert p.chosen_k is None and p.binding == "nothing_fits"
    assert p.min_feasible_budget_ms == pytest.approx(1.1 * 120 + 10.0)
    assert "k=0" in p.message
    assert _plan(budget_ms=p.min_feasible_budget_ms, overhead_ms=10.0).chosen_k == 0


def test_question_overflowing_the_window_has_no_feasible_budget() -> None:
    p = _plan(question_tokens=5000, budget_ms=1e9)
    assert p.chosen_k is None and p.binding == "nothing_fits" and p.min_feasible_budget_ms is None


def test_chunks_are_taken_in_rank_order_not_by_size() -> None:
    # A big first chunk blocks the small ones behind it: no skipping, no reordering.
    p = _plan(chunk_tokens=[1000, 10, 10], budget_ms=400.0)
    assert p.chosen_k == 0 and p.binding == "budget"
    assert [r.prompt_tokens for r in p.rows] == [100, 1100, 1110, 1120]


def test_plan_names_its_profile_and_serialises() -> None:
    d = _plan().to_dict()
    assert d["profile_id"] == EXACT.id and d["profile_source"] == "fitted"
    assert d["rows"][0]["k"] == 0 and 0 < d["budget_used_fraction"] <= 1


@pytest.mark.parametrize("budget", [0.0, -5.0, float("nan"), float("inf")])
def test_non_positive_or_non_finite_budget_is_invalid(budget: float) -> None:
    with pytest.raises(InvalidInput):
        _plan(budget_ms=budget)


def test_negative_chunk_tokens_are_invalid() -> None:
    with pytest.raises(InvalidInput):
        _plan(chunk_tokens=[10, -1])


def test_negative_overhead_is_invalid() -> None:
    with pytest.raises(InvalidInput):
        _plan(overhead_ms=-1.0)


def test_warm_chunks_are_priced_as_cached_and_a_larger_k_fits() -> None:
    # prompts 100, 200, ..., 500 (scaffold 80, question 20); cold p95(k) = 1.1 * (100 + n - 80)
    cold = _plan(budget_ms=400.0)
    assert cold.chosen_k == 2
    warm = _plan(budget_ms=400.0, cached_tokens=[80, 180, 280, 380, 480])
    assert [r.cached_tokens for r in warm.rows] == [80, 180, 280, 380, 480]
    assert [r.computed_tokens for r in warm.rows] == [20] * 5
    assert warm.chosen_k == 4 and warm.binding == "candidates_exhausted"


def test_per_k_counts_override_the_scaffold_flag() -> None:
    p = _plan(scaffold_cached=False, cached_tokens=[80, 80, 0, 0, 0])
    assert [r.cached_tokens for r in p.rows] == [80, 80, 0, 0, 0]


@pytest.mark.parametrize("cached", [[80] * 4, [80] * 6, [80, 80, 80, 80, 501], [80, -1, 80, 80, 80]])
def test_per_k_counts_are_checked(cached: list[int]) -> None:
    with pytest.raises(InvalidInput):
        _plan(cached_tokens=cached)


def test_a_chain_cached_past_the_scaffold_resumes_on_the_chunk_grid() -> None:
    from latency_model.calibration import calibrate
    from latency_model.grid import quick_grid
    from latency_model.planner import chunking_prefix
    from tests.latency_model.conftest import no_cpu_probe
    from tests.latency_model.test_step_model import FakeStepTimer

    assert chunking_prefix(83, 0) == 83 and chunking_prefix(83, 339) == 339
    prof = calibrate(FakeStepTimer(noise=0.01), grid=quick_grid(2048, [83], 256), seed=5,
                     progress=False, cpu_probe=no_cpu_probe)
    kw: dict[str, object] = dict(question_tokens=20, scaffold_tokens=83, scaffold_cached=True,
                                 chunk_tokens=[256, 256, 256], budget_ms=60_000.0, profile=prof,
                                 max_new_tokens=16, context_window=4096)
    cold = plan(**kw)  # type: ignore[arg-type]
    warm = plan(**kw, cached_tokens=[83, 339, 595, 851])  # type: ignore[arg-type]
    assert warm.rows[0].ttft_p50_ms == cold.rows[0].ttft_p50_ms
    assert all(w.ttft_p50_ms < c.ttft_p50_ms for w, c in zip(warm.rows[1:], cold.rows[1:], strict=True))
