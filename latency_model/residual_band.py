"""The residual band: a prediction's p95/p50 multiplier from served answers of its size.

Split-conformal prediction (Vovk et al., *Algorithmic Learning in a Random World*, 2005;
Angelopoulos & Bates, *A Gentle Introduction to Conformal Prediction*, 2021) over the scores
``measured / (fitted p50 x factor)`` of answers already served, localised to the prediction's
prompt size (:func:`residual_multipliers`). Used by :mod:`latency_model.correction`.
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
