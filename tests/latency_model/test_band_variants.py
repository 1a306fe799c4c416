"""The p95 band's candidate rules (latency_model.residual_band): split-conformal and weighted
conformal ranks on hand-made windows, Mondrian classes that really keep apart, and coverage of
a Mondrian band on synthetic exchangeable streams."""

from __future__ import annotations

import numpy as np
import pytest

from foundation.errors import InvalidInput
from latency_model.residual_band import (
    GROUP_MIN,
    class_multipliers,
    mondrian_multiplier,
    size_class,
    split_conformal,
    weighted_conformal,
)


def test_split_conformal_takes_rank_ceil_n_plus_one_times_095() -> None:
    # 19 scores: rank ceil(20 x 0.95) = 19, the largest; 39 scores: rank 38.
    nineteen = np.arange(1, 20, dtype=float)[::-1]  # order does not matter
    assert split_conformal(nineteen) == 19.0
    assert split_conformal(np.arange(1, 40, dtype=float)) == 38.0
    assert split_conformal(np.arange(1, 19, dtype=float)) is None  # 18: rank 19 is beyond them


def test_weighted_conformal_with_no_decay_is_the_split_rank() -> None:
    for n in (19, 25, 39, 40, 80):
        scores = np.random.default_rng(n).random(n)
        assert weighted_conformal(scores, 1.0) == split_conformal(scores)


def test_weighted_conformal_counts_the_test_points_weight_and_favours_new_scores() -> None:
    # Weights 0.5^3, 0.5^2, 0.5 (oldest first) and the test point's 1: total 1.875. Scores 3, 2, 1:
    # at 1 the share is 0.5 / 1.875, at 2 0.75 / 1.875, at 3 0.875 / 1.875 < 0.95: no bound.
    assert weighted_conformal([3.0, 2.0, 1.0], 0.5) is None
    # Decay 0.9: the scores weigh at most 9 against the test point's 1, never 0.95 of the total.
    assert weighted_conformal(np.ones(500), 0.9) is None
    # Decay 0.99: 20 large old scores, then 300 small ones. Unweighted, rank 305 of 320 is large;
    # weighted, the old ones hold ~1 % of the weight and the bound is among the small ones.
    old, new = np.full(20, 5.0), np.linspace(1.0, 1.3, 300)
    assert split_conformal(np.concatenate([old, new])) == 5.0
    bound = weighted_conformal(np.concatenate([old, new]), 0.99)
    assert bound is not None and bound <= 1.3
    # Reversed (the large scores newest, ~19 % of the weight) the bound is the large score.
    assert weighted_conformal(np.concatenate([new, old]), 0.99) == 5.0
    with pytest.raises(InvalidInput):
        weighted_conformal([1.0], 0.0)


def test_mondrian_multiplier_rank_and_drift_guard() -> None:
    calm = np.concatenate([[3.0], np.linspace(1.0, 1.1, 39)])  # a slow answer, then 39 calm ones
    # 40 scores: rank 39 = the second largest (1.1); the guard reads the newest 19 only.
    assert mondrian_multiplier(calm, guard=False) == pytest.approx(1.1)
    assert mondrian_multiplier(calm, guard=True) == pytest.approx(1.1)
    slow_last = np.concatenate([np.linspace(1.0, 1.1, 39), [3.0]])
    assert mondrian_multiplier(slow_last[:-1].tolist() + [1.05, 1.02, 3.0], guard=True) == 3.0
    assert mondrian_multiplier(np.full(GROUP_MIN - 1, 1.0)) is None
    assert mondrian_multiplier(np.full(GROUP_MIN, 0.5)) == 1.0  # never below p50


def test_size_classes_are_doublings_of_the_fitted_p50() -> None:
    assert size_class(100.0) == size_class(127.0) == 6
    assert size_class(128.0) == 7 and size_class(1000.0) == 9


def test_each_class_reads_its_own_window_only() -> None:
    """Short prompts (100 ms) scoring 2.0 and long ones (1000 ms) scoring 1.0-1.1, interleaved:
    each class's multiplier is its own; a class with too few answers has none."""
    hist = []
    for i in range(40):
        hist.append((100.0, 2.0))
        hist.append((1000.0, 1.0 + 0.1 * i / 39))
    got = class_multipliers(hist, [100.0, 1000.0, 10_000.0], keep=40, guard=False)
    assert got[0] == 2.0
    assert got[1] == pytest.approx(split_conformal([1.0 + 0.1 * i / 39 for i in range(40)]))
    assert np.isnan(got[2])
    # keep: only the newest 20 of the long class count (the oldest 20 made far larger here).
    old_big = [(1000.0, 9.0)] * 20 + [(1000.0, 1.0)] * 20
    assert class_multipliers(old_big, [1000.0], keep=20)[0] == 1.0
    assert class_multipliers(old_big, [1000.0], keep=40)[0] == 9.0
    with pytest.raises(InvalidInput):
        class_multipliers(hist, [100.0], keep=GROUP_MIN - 1)


@pytest.mark.parametrize("guard", [False, True])
def test_a_mondrian_band_covers_an_exchangeable_stream(guard: bool) -> None:
    """Two classes with different lognormal spreads, answers i.i.d. within each: averaged over
    200 seeded streams the share of next answers at or under their class's multiplier is at
    least 0.95 less a tolerance (finite-sample validity per class, Vovk et al. 2005, 4.5)."""
    hits = total = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        hist: list[tuple[float, float]] = []
        for _ in range(120):
            p50 = 100.0 if rng.random() < 0.4 else 1000.0
            score = float(np.exp(rng.normal(0.0, 0.25 if p50 < 500 else 0.08)))
            mult = class_multipliers(hist, [p50], keep=40, guard=guard)[0] if hist else np.nan
            if not np.isnan(mult):
                hits += score <= mult
                total += 1
            hist.append((p50, score))
    assert total > 10_000
    assert hits / total >= 0.95 - 0.005
