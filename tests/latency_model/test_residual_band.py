"""The online correction's residual band: once enough answers are served, p95 comes from their
own residuals (per prompt size), not from the fitted p95/p50 spread (latency_model.correction)."""

from __future__ import annotations

import random

import pytest

from latency_model.correction import GROUP_MIN, OnlineCorrection, residual_multipliers

#: A fitted band as wide as the shared VM's calibration left it: p95 = 1.7 x p50.
FITTED_SPREAD = 1.7


def _spread(c: OnlineCorrection, p50: float = 100.0) -> float:
    """The corrected p95/p50 of a prompt whose fitted p50 is ``p50`` ms, under the state now."""
    c50, c95 = c.apply([p50], [p50 * FITTED_SPREAD], c.state())
    return float(c95[0] / c50[0])


def _tight(rng: random.Random) -> float:
    return 1.0 + 0.04 * rng.random()  # served prefills within 1.00-1.04x their prediction


def test_fewer_answers_than_the_conformal_rank_keep_the_fitted_spread() -> None:
    c = OnlineCorrection("p", window=40, min_samples=5, residual_band=True)
    rng = random.Random(1)
    for _ in range(GROUP_MIN - 1):
        c.observe(100.0, 100.0 * _tight(rng))
    assert not c.state().residual_band
    assert _spread(c) == pytest.approx(FITTED_SPREAD)


def test_a_window_of_tight_residuals_gives_a_narrow_band_after_enough_answers() -> None:
    c = OnlineCorrection("p", window=40, min_samples=5, residual_band=True)
    rng = random.Random(2)
    ratios = [_tight(rng) for _ in range(GROUP_MIN)]
    for r in ratios:
        c.observe(100.0, 100.0 * r)
    st = c.state()
    assert st.residual_band and st.to_dict()["residual_band"] is True
    assert _spread(c) < 1.05  # the served answers' width, not the fitted 1.7
    _, p95 = c.apply([100.0], [170.0], st)
    assert all(100.0 * r <= p95[0] + 1e-9 for r in ratios)
    # The same window under the earlier rule keeps the fitted spread (no machine speed).
    old = c.state(residual_band=False)
    assert c.apply([100.0], [170.0], old)[1][0] == pytest.approx(170.0 * old.factor)


def test_drift_widens_the_band_again_at_the_next_answer() -> None:
    c = OnlineCorrection("p", window=40, min_samples=5, residual_band=True)
    rng = random.Random(3)
    for _ in range(40):
        c.observe(100.0, 100.0 * _tight(rng))
    narrow = _spread(c)
    c.observe(100.0, 150.0)  # a neighbour arrives: one answer 1.5x its prediction
    wide = _spread(c)
    assert narrow < 1.05 and wide > 1.4
    # Once the slow answer has left the newest GROUP_MIN and no other followed, the band narrows.
    for _ in range(GROUP_MIN):
        c.observe(100.0, 100.0 * _tight(rng))
    assert _spread(c) < 1.05


def test_each_prompt_size_gets_the_spread_of_answers_of_its_size() -> None:
    """Short prompts (fitted p50 100 ms) measure 0.8-1.6x, long ones (1000 ms) 0.95-1.05x, in one
    window: a long prompt's band is narrow, a short one's wide, each covering its own answers;
    one multiplier over the pooled window would give the long prompt the short prompts' width."""
    rng = random.Random(4)
    short = [0.8 + 0.8 * rng.random() for _ in range(20)]
    long_ = [0.95 + 0.1 * rng.random() for _ in range(20)]
    c = OnlineCorrection("p", window=40, min_samples=5, residual_band=True)
    for s, lo in zip(short, long_, strict=True):
        c.observe(100.0, 100.0 * s)
        c.observe(1000.0, 1000.0 * lo)
    st = c.state()
    c50, c95 = c.apply([100.0, 1000.0], [170.0, 1700.0], st)
    assert c95[1] / c50[1] < 1.2 < c95[0] / c50[0]
    assert all(100.0 * s <= c95[0] + 1e-9 for s in short)
    assert all(1000.0 * lo <= c95[1] + 1e-9 for lo in long_)
    pooled = c.state(residual_band=False)
    assert c.apply([1000.0], [1000.0], pooled)[1][0] > c95[1]


def test_residual_multipliers_refuse_too_few_answers() -> None:
    from foundation.errors import InvalidInput

    with pytest.raises(InvalidInput):
        residual_multipliers([(100.0, 1.0)] * (GROUP_MIN - 1), [100.0])
    one_size = [(100.0, 1.0 + 0.01 * i) for i in range(40)]
    # One prompt size: the whole window, its conformal rank or the newest GROUP_MIN's largest.
    assert residual_multipliers(one_size, [100.0])[0] == pytest.approx(1.39)


def test_the_setting_and_a_plan_choose_the_rule() -> None:
    """``RAGBUDGET_CORRECTION_RESIDUAL_BAND`` reaches the answer path's switches; a plan's
    :class:`CorrectedProfile` takes the rule it is given over the correction's own."""
    from types import SimpleNamespace

    from app.answering.state import AnswerSwitches
    from latency_model.correction import CorrectedProfile

    base = {"late_binding": True, "online_correction": True, "correction_live_speed": True}
    # Off by default (it under-covered the fleet's third run: docs/latency_model.md).
    assert not AnswerSwitches.of(SimpleNamespace(**base)).residual_band
    assert AnswerSwitches.of(SimpleNamespace(**base, correction_residual_band=True)).residual_band
    assert not OnlineCorrection("p").residual_band
    c = OnlineCorrection("p", window=40, min_samples=5, residual_band=True)
    for _ in range(GROUP_MIN):
        c.observe(100.0, 100.0)

    class Fitted:
        id, source = "p", "fitted"

        def predict_ttft_many(self, n, c_, prefix=None):  # type: ignore[no-untyped-def]
            import numpy as np
            return np.array([100.0]), np.array([170.0])

    assert CorrectedProfile(Fitted(), c).predict_ttft_ms(1, 0)[1] == pytest.approx(100.0)
    assert CorrectedProfile(Fitted(), c, residual_band=False).predict_ttft_ms(1, 0)[1] == pytest.approx(170.0)
