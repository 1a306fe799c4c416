"""The residual band: a prediction's p95/p50 multiplier from served answers of its size.

Split-conformal prediction (Vovk et al., *Algorithmic Learning in a Random World*, 2005;
Angelopoulos & Bates, *A Gentle Introduction to Conformal Prediction*, 2021) over the scores
``measured / (fitted p50 x factor)`` of answers already served, localised to the prediction's
prompt size (:func:`residual_multipliers`). Used by :mod:`latency_model.correction` when its
``residual_band`` is on (off by default). Also the candidate rules the offline replay
(:mod:`benchmarks.band_replay`, ``--variants``) compares: Mondrian classes by size, each with
its own window (:func:`class_multipliers`, :func:`mondrian_multiplier`), and drift-aware
weighted conformal (:func:`weighted_conformal`); none of them is used by the correction, as
none covered both fleet runs narrower than the earlier rule (docs/latency_model.md, "Variants
on both runs").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from foundation.errors import InvalidInput

COVERAGE = 0.95
#: The fewest scores whose conformal rank ``ceil((n + 1) x COVERAGE)`` is within them (19 at 0.95).
GROUP_MIN = next(n for n in range(1, 1000) if math.ceil((n + 1) * COVERAGE) <= n)


def _conformal(scores: NDArray[np.float64]) -> float:
    """The ``ceil((n + 1) x COVERAGE)``-th smallest of ``scores`` (n >= :data:`GROUP_MIN`)."""
    ordered = np.sort(scores)
    return float(ordered[math.ceil((ordered.size + 1) * COVERAGE) - 1])


def split_conformal(scores: ArrayLike) -> float | None:
    """The split-conformal bound of ``scores`` (any order): the ``ceil((n + 1) x 0.95)``-th
    smallest of the n scores, or ``None`` when that rank is beyond them (n < :data:`GROUP_MIN`).
    A new score exchangeable with them is at or under it with probability >= 0.95 (Vovk et al.
    2005; Angelopoulos & Bates 2021, section 1)."""
    arr = np.asarray(scores, dtype=np.float64).ravel()
    return _conformal(arr) if arr.size >= GROUP_MIN else None


def weighted_conformal(scores: ArrayLike, decay: float) -> float | None:
    """The drift-aware weighted conformal bound of ``scores`` (oldest first, ``(n,)``).

    Barber, Candès, Ramdas & Tibshirani, *Conformal prediction beyond exchangeability*
    (Ann. Statist. 2023), section 4 with fixed weights: the i-th of n scores weighs
    ``decay ** (n + 1 - i)`` (the newest ``decay``), the test point 1; the bound is the
    smallest score at which the normalised weight of the scores at or under it reaches 0.95,
    the test point's weight counted as a point at +inf. ``None`` when the weight of all n
    scores falls short of 0.95 (too few, or decayed too fast). ``decay`` in (0, 1]; 1 is
    :func:`split_conformal`.

    Raises:
        InvalidInput: ``decay`` outside (0, 1].
    """
    if not 0.0 < decay <= 1.0:
        raise InvalidInput("need 0 < decay <= 1", field="decay")
    arr = np.asarray(scores, dtype=np.float64).ravel()
    if arr.size == 0:
        return None
    w = decay ** np.arange(arr.size, 0, -1, dtype=np.float64)  # oldest smallest
    total = float(w.sum()) + 1.0
    order = np.argsort(arr, kind="stable")
    cum = np.cumsum(w[order]) / total
    hit = np.flatnonzero(cum >= COVERAGE - 1e-12)
    return float(arr[order[hit[0]]]) if hit.size else None


def size_class(p50_ms: float) -> int:
    """The Mondrian size class of a prediction of fitted p50 ``p50_ms``: ``floor(log2(ms))``
    (each class one doubling of the fitted prefill; a prompt with no chunk and one with
    several chunks fall in different classes on every engine measured)."""
    return int(math.floor(math.log2(max(p50_ms, 1e-9))))


def mondrian_multiplier(scores: ArrayLike, guard: bool = True) -> float | None:
    """The p95/p50 multiplier of one Mondrian class from its scores (oldest first, the class's
    own window): the split-conformal bound (:func:`split_conformal`), with ``guard`` raised to
    the largest score of the newest :data:`GROUP_MIN` (the drift guard); ``None`` below
    :data:`GROUP_MIN` scores. Within a fixed taxonomy (Vovk et al. 2005, section 4.5:
    Mondrian conformal prediction) the bound is finite-sample valid per class when the class's
    scores are exchangeable."""
    arr = np.asarray(scores, dtype=np.float64).ravel()
    bound = split_conformal(arr)
    if bound is None:
        return None
    if guard:
        bound = max(bound, float(arr[-GROUP_MIN:].max()))
    return max(bound, 1.0)


def residual_multipliers(residuals: Sequence[tuple[float, float]], p50_ms: ArrayLike,
                         neighbours: int = GROUP_MIN) -> NDArray[np.float64]:
    """The p95/p50 multiplier of each fitted p50 in ``p50_ms`` from served answers' residuals.

    ``residuals``: ``(fitted p50 ms, score)`` of each answer learned from, oldest first (at least
    ``neighbours`` of them; ``score`` = measured / (fitted p50 x factor)). For a prediction of
    fitted p50 ``x`` the scores of its ``neighbours`` nearest answers in ``|log(p50) - log(x)|``
    are taken (the newer first among equals, and every answer as near as the farthest of them,
    so a window of one prompt size is the whole window): the multiplier is the larger of their
    split-conformal score (the ``ceil((m + 1) x 0.95)``-th smallest of the m taken) and the
    largest score of the newest ``neighbours`` of them (a short-window conformal bound, the
    drift guard: one slow answer widens the next plan of its size). Localised conformal
    prediction (Guan, *Localized conformal prediction*, Biometrika 2023) weighs calibration
    scores by nearness in the input; this is its nearest-neighbour form, which is valid in finite
    samples only for a fixed taxonomy (Mondrian) and is checked empirically
    (docs/latency_model.md, "Where the band's width comes from"). Sizes matter because the
    relative spread of served prefills shrinks with the prompt: a prompt of 10-20 computed tokens
    carries the request's fixed costs, one of 100+ tokens mostly compute.

    Returns:
        ``(len(p50_ms),)`` float64 multipliers, each >= 1 (not capped here).

    Raises:
        InvalidInput: fewer than ``neighbours`` residuals, or ``neighbours`` < :data:`GROUP_MIN`.
    """
    if neighbours < GROUP_MIN or len(residuals) < neighbours:
        raise InvalidInput(f"need >= {max(neighbours, GROUP_MIN)} residuals and neighbours >= "
                           f"{GROUP_MIN}", field="residuals")
    arr = np.asarray(residuals, dtype=np.float64)  # (n, 2)
    logs, scores = np.log(arr[:, 0]), arr[:, 1]
    age = np.arange(arr.shape[0])[::-1]  # 0: the newest
    x = np.log(np.maximum(np.asarray(p50_ms, dtype=np.float64).ravel(), 1e-9))
    out = np.empty(x.shape, dtype=np.float64)
    for j, xj in enumerate(x):
        dist = np.abs(logs - xj)
        near = np.lexsort((age, dist))  # nearest first, the newer first among equals
        radius = dist[near[neighbours - 1]]
        taken = np.flatnonzero(dist <= radius)  # arrival order
        newest = scores[taken[-neighbours:]]
        out[j] = max(_conformal(scores[taken]), float(newest.max()), 1.0)
    return out


def class_multipliers(residuals: Sequence[tuple[float, float]], p50_ms: ArrayLike, keep: int,
                      guard: bool = True, decay: float | None = None) -> NDArray[np.float64]:
    """Mondrian p95/p50 multipliers: each prediction's from its own size class alone.

    ``residuals``: ``(fitted p50 ms, score)`` of served answers, oldest first. For a prediction
    of fitted p50 ``x`` the class is :func:`size_class` of ``x``; the newest ``keep`` scores of
    that class (and of no other) give :func:`mondrian_multiplier` (``decay`` ``None``) or
    :func:`weighted_conformal` (``decay`` set; ``guard`` unused then), at least 1.

    Returns:
        ``(len(p50_ms),)`` float64; NaN where the class holds no bound (too few scores).

    Raises:
        InvalidInput: ``keep`` < :data:`GROUP_MIN`.
    """
    if keep < GROUP_MIN:
        raise InvalidInput(f"need keep >= {GROUP_MIN}", field="keep")
    classes = np.array([size_class(p) for p, _ in residuals], dtype=np.int64)
    scores = np.array([s for _, s in residuals], dtype=np.float64)
    out = np.full(np.asarray(p50_ms).size, np.nan)
    for j, x in enumerate(np.asarray(p50_ms, dtype=np.float64).ravel()):
        mine = scores[classes == size_class(float(x))][-keep:]
        bound = (mondrian_multiplier(mine, guard) if decay is None
                 else weighted_conformal(mine, decay))
        if bound is not None:
            out[j] = max(bound, 1.0)
    return out
