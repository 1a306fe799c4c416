"""Fitting cost models to timed samples: residual quantiles, held-out error, form selection.

All error figures are fractions (``0.021`` = 2.1 %). Residuals are relative:
``r = measured / predicted - 1``, so a band ``[predicted*(1+q05), predicted*(1+q95)]``
scales with the prediction.

Held-out error is leave-one-length-out: every distinct prompt length (all its
cached variants and repeats) is predicted by a fit that never saw that
length, the cross-validation Vidur uses to report predictor error on unseen
shapes. Fresh points measured in the same interleaved run but never fitted
give the p95 coverage (:func:`coverage`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from foundation.errors import InvalidInput
from latency_model.predictors import (
    DEFAULT_PREFILL_MODEL,
    PREFILL_MODELS,
    DecodePredictor,
    PrefillPredictor,
    decode_model,
    prefill_model,
)

# Quantile levels kept with every profile, by key.
QUANTILES: dict[str, float] = {"p05": 0.05, "p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99}
# Prompts computing at most this many tokens get an absolute (ms) band too: their jitter
# (thread wake-ups, dispatch) is a few ms whatever the work, so large relative to it.
SHORT_COMPUTED_TOKENS = 128
# Held-out MAPEs closer than this (absolute fraction, 0.5 percentage points) are a tie, and a tie
# goes to the physically right form (PHYSICAL_ORDER). Why 0.5 points: on this CPU the same quick
# grid calibrated twice on a quiet machine moved one form's leave-one-length-out MAPE by 0.25 to
# 0.39 points (quadratic 3.61 % vs 3.36 %, two_path 2.82 % vs 3.21 %, docs/latency_model.md), so
# smaller differences do not repeat; the run before this rule picked a form on a 0.15-point gap.
SELECTION_TOLERANCE = 0.005
# Forms from most to least physically right for the engines ragbudget times: ``chunked`` prices
# the forward passes the chunked engine really runs (only a candidate when the chunk size is
# known), ``quadratic`` is the documented default, ``quadratic_split`` adds a term without a mechanism
# in this engine, ``two_path`` models a masked-attention path the old engine took (SDPA's
# explicit mask after a cached prefix) and ``linear`` leaves attention out.
PHYSICAL_ORDER = ("chunked", "quadratic", "quadratic_split", "two_path", "linear")


def _f64(values: ArrayLike) -> NDArray[np.float64]:
    return np.atleast_1d(np.asarray(values, dtype=np.float64))


def relative_residuals(measured_ms: ArrayLike, predicted_ms: ArrayLike) -> NDArray[np.float64]:
    """``measured / predicted - 1`` elementwise, shape ``(N,)``.

    Raises:
        InvalidInput: a prediction is not > 0.
    """
    y, p = _f64(measured_ms), _f64(predicted_ms)
    if np.any(p <= 0):
        raise InvalidInput("predictions must be > 0 ms to form relative residuals")
    return np.asarray(y / p - 1.0, dtype=np.float64)


def residual_quantiles(residuals: ArrayLike) -> dict[str, float]:
    """Quantiles of relative residuals, keyed ``p05 .. p99``.

    ``p50`` is the plain median. For the tails a split-conformal correction is
    applied: an upper level ``q`` is read at ``min(1, q*(N+1)/N)`` with the
    ``higher`` rule (lower levels mirrored), so with ``N`` residuals an
    unseen point falls below the ``q`` quantile with probability at least
    ``q`` when the residuals are exchangeable (Vovk et al., 2005; Lei et al., 2018).

    Raises:
        InvalidInput: no residuals.
    """
    r = _f64(residuals)
    if r.size == 0:
        raise InvalidInput("no residuals to take quantiles of")
    n = r.size
    out = {}
    for key, q in QUANTILES.items():
        if q == 0.5:
            out[key] = float(np.median(r))
        elif q > 0.5:
            out[key] = float(np.quantile(r, min(1.0, q * (n + 1) / n), method="higher"))
        else:
            out[key] = float(np.quantile(r, max(0.0, (q * (n + 1) - 1) / n), method="lower"))
    return out


def absolute_quantiles(measured_ms: ArrayLike, predicted_ms: ArrayLike, computed_tokens: ArrayLike,
                       short_tokens: int = SHORT_COMPUTED_TOKENS) -> dict[str, float]:
    """Quantiles (ms) of ``measured - predicted`` over short prompts (``computed <= short_tokens``).

    Same keys and conformal rule as :func:`residual_quantiles`; ``{}`` when fewer
    than three short samples exist.
    """
    y, p, m = _f64(measured_ms), _f64(predicted_ms), _f64(computed_tokens)
    short = m <= short_tokens
    if int(short.sum()) < 3:
        return {}
    return residual_quantiles(y[short] - p[short])


def mape(measured_ms: ArrayLike, predicted_ms: ArrayLike) -> float:
    """Mean absolute percentage error as a fraction: ``mean(|predicted - measured| / measured)``."""
    y, p = _f64(measured_ms), _f64(predicted_ms)
    if y.size == 0:
        raise InvalidInput("no points to score")
    return float(np.mean(np.abs(p - y) / y))


def coverage(measured_ms: ArrayLike, upper_ms: ArrayLike) -> float:
    """Fraction of measurements at or below their predicted upper bound (e.g. the p95)."""
    y, u = _f64(measured_ms), _f64(upper_ms)
    if y.size == 0:
        raise InvalidInput("no points to score")
    return float(np.mean(y <= u))


def leave_one_group_out(fit_and_predict, groups: NDArray[np.float64], n_points: int) -> NDArray[np.float64]:  # type: ignore[no-untyped-def]
    """Held-out predictions: for each distinct value in ``groups``, fit without it, predict it.

    ``fit_and_predict(train_mask, test_mask) -> predictions for test rows``.
    Returns ``(n_points,)`` held-out predictions.

    Raises:
        InvalidInput: fewer than three distinct groups.
    """
    values = np.unique(groups)
    if values.size < 3:
        raise InvalidInput("leave-one-out needs at least three distinct lengths")
    out = np.empty(n_points, dtype=np.float64)
    for v in values:
        test = groups == v
        out[test] = fit_and_predict(~test, test)
    return out


@dataclass(frozen=True)
class PrefillFit:
    """A fitted prefill model with its residual quantiles and errors (fractions)."""

    predictor: PrefillPredictor
    quantiles: dict[str, float]
    in_sample_mape: float
    loo_length_mape: float
    abs_quantiles_ms: dict[str, float]


@dataclass(frozen=True)
class DecodeFit:
    """A fitted decode model with its residual quantiles and errors (fractions)."""

    predictor: DecodePredictor
    quantiles: dict[str, float]
    in_sample_mape: float
    loo_context_mape: float | None


def fit_prefill(prompt_tokens: ArrayLike, cached_tokens: ArrayLike, ttft_ms: ArrayLike,
                model: str = DEFAULT_PREFILL_MODEL, chunk_tokens: int | None = None) -> PrefillFit:
    """Fit prefill model ``model`` on all points; score it leave-one-length-out.

    Args:
        prompt_tokens, cached_tokens, ttft_ms: ``(N,)`` samples (every repeat its own row).
        model: a name in ``latency_model.predictors.PREFILL_MODELS``.
        chunk_tokens: the engine's prefill chunk size (needed by ``chunked``).

    Raises:
        InvalidInput: unknown model, bad samples, fewer than three distinct prompt lengths, or
            a chunked form without ``chunk_tokens``.
    """
    cls = prefill_model(model)
    n, c, y = _f64(prompt_tokens), _f64(cached_tokens), _f64(ttft_ms)
    predictor = cls.fit(n, c, y, chunk_tokens)
    fitted = predictor.predict_ms(n, c)

    def _fp(train: NDArray[np.bool_], test: NDArray[np.bool_]) -> NDArray[np.float64]:
        return cls.fit(n[train], c[train], y[train], chunk_tokens).predict_ms(n[test], c[test])

    held_out = leave_one_group_out(_fp, n, n.size)
    return PrefillFit(predictor=predictor,
                      quantiles=residual_quantiles(relative_residuals(y, fitted)),
                      abs_quantiles_ms=absolute_quantiles(y, fitted, n - c),
                      in_sample_mape=mape(y, fitted),
                      loo_length_mape=mape(y, np.maximum(held_out, 1e-9)))


def select_prefill(prompt_tokens: ArrayLike, cached_tokens: ArrayLike, ttft_ms: ArrayLike,
                   candidates: tuple[str, ...] | None = None,
                   chunk_tokens: int | None = None) -> tuple[PrefillFit, dict[str, float]]:
    """Fit every candidate form; keep the physically rightest of those the held-out data favour.

    Every form within :data:`SELECTION_TOLERANCE` of the lowest leave-one-length-out MAPE
    ties; among the tied forms the first in :data:`PHYSICAL_ORDER` wins (a form not listed
    there ranks last, then by name). ``chunked`` is a candidate only with ``chunk_tokens``.

    Returns:
        ``(chosen fit, {form name: loo_length_mape})``.
    """
    names = candidates or tuple(name for name, cls in PREFILL_MODELS.items()
                                if chunk_tokens is not None or not cls.needs_chunk_tokens)
    fits = {name: fit_prefill(prompt_tokens, cached_tokens, ttft_ms, name, chunk_tokens)
            for name in names}
    scores = {name: f.loo_length_mape for name, f in fits.items()}
    return fits[pick_form(scores)], scores


def pick_form(scores: dict[str, float], tolerance: float = SELECTION_TOLERANCE) -> str:
    """The form :func:`select_prefill` keeps: the first in :data:`PHYSICAL_ORDER` among those
    whose score (a held-out MAPE, fraction) is within ``tolerance`` of the lowest.

    Raises:
        InvalidInput: no scores.
    """
    if not scores:
        raise InvalidInput("no forms to choose from")
    best = min(scores.values())
    tied = [name for name, v in scores.items() if v <= best + tolerance]

    def rank(name: str) -> tuple[int, str]:
        return (PHYSICAL_ORDER.index(name) if name in PHYSICAL_ORDER else len(PHYSICAL_ORDER), name)

    return min(tied, key=rank)


def fit_decode(context_tokens: ArrayLike, tpot_ms: ArrayLike, model: str = "linear_decode") -> DecodeFit:
    """Fit the decode model; leave-one-context-out MAPE when there are >= 3 contexts.

    Raises:
        InvalidInput: unknown model or bad samples.
    """
    cls = decode_model(model)
    ctx, y = _f64(context_tokens), _f64(tpot_ms)
    predictor = cls.fit(ctx, y)
    fitted = predictor.predict_ms(ctx)
    loo: float | None = None
    if np.unique(ctx).size >= 3:
        def _fp(train: NDArray[np.bool_], test: NDArray[np.bool_]) -> NDArray[np.float64]:
            return cls.fit(ctx[train], y[train]).predict_ms(ctx[test])

        loo = mape(y, np.maximum(leave_one_group_out(_fp, ctx, ctx.size), 1e-9))
    return DecodeFit(predictor=predictor,
                     quantiles=residual_quantiles(relative_residuals(y, fitted)),
                     in_sample_mape=mape(y, fitted), loo_context_mape=loo)


def finite_or_none(x: float | None) -> float | None:
    """``x`` when finite, else ``None`` (JSON cannot carry NaN)."""
    return None if x is None or not math.isfinite(x) else float(x)
