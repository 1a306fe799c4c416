"""Fitting helpers: residual quantiles, MAPE, coverage, held-out error and form selection."""

from __future__ import annotations

import numpy as np
import pytest

from foundation.errors import InvalidInput
from latency_model.fitting import (
    SELECTION_TOLERANCE,
    coverage,
    fit_decode,
    fit_prefill,
    mape,
    pick_form,
    relative_residuals,
    residual_quantiles,
    select_prefill,
)
from latency_model.predictors import ChunkedPrefill, QuadraticPrefill, QuadraticSplitPrefill

N = np.repeat([8, 32, 96, 256, 512, 1024, 2048], 3).astype(float)
C = np.zeros_like(N)


def test_mape_is_a_fraction_of_the_measurement() -> None:
    assert mape([100.0, 200.0], [110.0, 180.0]) == pytest.approx(0.10)


def test_coverage_counts_measurements_at_or_below_the_bound() -> None:
    assert coverage([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 5.0, 5.0]) == pytest.approx(0.75)


def test_relative_residuals_are_measured_over_predicted_minus_one() -> None:
    assert relative_residuals([110.0, 90.0], [100.0, 100.0]) == pytest.approx([0.1, -0.1])


def test_upper_quantile_is_conservative_for_small_samples() -> None:
    r = np.linspace(-0.1, 0.1, 20)
    q = residual_quantiles(r)
    assert q["p95"] >= np.quantile(r, 0.95)
    assert q["p05"] <= q["p50"] <= q["p90"] <= q["p95"] <= q["p99"]


def test_noiseless_quadratic_data_has_zero_held_out_error() -> None:
    truth = QuadraticPrefill({"a": 12.0, "b": 0.9, "g": 2.5e-5})
    fit = fit_prefill(N, C, truth.predict_ms(N, C))
    assert fit.loo_length_mape < 1e-9
    assert fit.in_sample_mape < 1e-9


def test_leave_one_length_out_needs_three_lengths() -> None:
    with pytest.raises(InvalidInput):
        fit_prefill([8, 8, 16, 16], [0, 0, 0, 0], [1.0, 1.0, 2.0, 2.0])


def test_selection_keeps_the_default_form_when_it_is_as_good() -> None:
    truth = QuadraticPrefill({"a": 12.0, "b": 0.9, "g": 2.5e-5})
    chosen, scores = select_prefill(N, C, truth.predict_ms(N, C))
    assert chosen.predictor.name == "quadratic"
    assert set(scores) == {"linear", "quadratic", "quadratic_split", "two_path"}


def test_selection_switches_form_when_held_out_data_favour_it() -> None:
    n = np.repeat([8, 32, 96, 256, 512, 1024, 2048, 300, 700, 1500], 2).astype(float)
    c = np.isin(n, [300, 700, 1500]) * 250.0
    truth = QuadraticSplitPrefill({"a": 3.0, "b": 0.2, "g": 1e-6, "h": 3e-4})
    chosen, scores = select_prefill(n, c, truth.predict_ms(n, c))
    assert chosen.predictor.name == "quadratic_split"
    assert scores["quadratic_split"] < scores["quadratic"]


def test_decode_fit_reports_leave_one_context_out_error() -> None:
    ctx = np.repeat([16.0, 512.0, 1024.0, 2048.0], 2)
    fit = fit_decode(ctx, 20.0 + 0.004 * ctx)
    assert fit.loo_context_mape is not None and fit.loo_context_mape < 1e-9


def test_selection_tie_goes_to_the_physically_right_form() -> None:
    # Within SELECTION_TOLERANCE (0.5 points) the forms tie and PHYSICAL_ORDER decides; outside
    # it the lower held-out error wins whatever the order.
    tie = SELECTION_TOLERANCE * 0.8
    assert pick_form({"two_path": 0.030, "quadratic": 0.030 + tie}) == "quadratic"
    assert pick_form({"two_path": 0.030, "quadratic": 0.030 + tie, "chunked": 0.030 + tie}) == "chunked"
    assert pick_form({"two_path": 0.030, "quadratic": 0.030 + 2 * SELECTION_TOLERANCE}) == "two_path"
    assert pick_form({"linear": 0.05, "quadratic_split": 0.05}) == "quadratic_split"


def test_selection_offers_the_chunked_form_only_with_the_chunk_size() -> None:
    truth = ChunkedPrefill({"a": 10.0, "k": 30.0, "b": 1.0, "g": 4e-4}, chunk_tokens=256)
    n = np.repeat([8, 45, 160, 251, 301, 512, 765, 1024, 1101, 1531, 2047], 2).astype(float)
    c = np.where(n > 83, np.tile([0.0, 83.0], n.size // 2), 0.0)
    chosen, scores = select_prefill(n, c, truth.predict_ms(n, c), chunk_tokens=256)
    assert chosen.predictor.name == "chunked" and chosen.loo_length_mape < 1e-9
    assert "chunked" not in select_prefill(n, c, truth.predict_ms(n, c))[1]
