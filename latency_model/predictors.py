"""Prefill and decode cost models: small predictor classes behind one interface, picked by name.

A predictor is a linear model over non-negative features of the token counts,
fitted by non-negative least squares with relative-error weighting (every row
divided by its measurement, so a 5 % miss on a 20 ms prompt costs as much as a
5 % miss on a 2 s prompt). The pattern (named predictors, fitted parameters
stored as JSON next to a hash of their training data) follows Microsoft's Vidur
execution-time predictors (Agrawal et al., MLSys 2024); the quadratic prefill
form follows DistServe's prefill estimator ``a + b*L + c*L^2`` (Zhong et al.,
OSDI 2024), extended to a prefix cache (docs/latency_model.md, "The model").

Prefill forms (n prompt tokens, c of them from the prefix cache, m = n - c):

==================  ==========================================  =====================================
name                ttft_ms                                     meaning of the terms
==================  ==========================================  =====================================
``linear``          a + b*m                                     fixed cost + per-token linear layers
``quadratic``       a + b*m + g*m*(n + c)                       + attention (the default)
``quadratic_split`` a + b*m + g*m*(n + c) + h*m^2               + extra causal self-attention cost
``two_path``        a + b*m + g*m*(n + c) + h*[c > 0]*m*n       + masked-attention cost of a cache hit
``chunked``         a + k*q + b*m + g*m*(n + c)                 + a fixed cost per forward pass (chunk)
==================  ==========================================  =====================================

``chunked`` is the form of the continuous-batching engine (``generation.scheduler``),
which prefills in chunks of ``S`` tokens whose boundaries are a pure function of
the prompt: the scaffold ``[0, P)`` from 0, the rest ``[P, n)`` from ``P``. So
``q = ceil((P - c)/S) + ceil((n - max(P, c))/S)`` forward passes run
(:func:`forward_passes`): ``ceil((n - c)/S)`` on a cache hit (``c = P``), one
chunk more than that at most on a miss (``c = 0``), ``ceil(n/S)`` with no
scaffold. Each pass pays the per-layer dispatch, the attention set-up and a
GEMM over at least 16 padded rows once; a cache miss pays that for the
scaffold's own chunk, so a cached 83-token scaffold saves ~150-230 ms on the
project's 2-vCPU VM where its 83 tokens alone would explain ~105 ms
(docs/latency_model.md, fitted k ~ 89 ms). ``S`` is the engine's setting, not a
fitted number: the predictor is built with ``chunk_tokens=S``.

Every form is a sum of non-negative coefficients times features that grow with
``m`` at a fixed cached length, so with non-negative coefficients predictions
are monotone in ``m``. For the first three forms the features also never grow
when cached tokens replace computed ones (``m*(n+c) = m*(2n - m)`` has
derivative ``2c >= 0`` in ``m`` at fixed ``n``), so a cache hit never predicts
a slower prefill (``cache_never_slower = True``).

``two_path`` exists because the data said so (docs/latency_model.md): in
transformers' SDPA attention a prefill without a cache runs the causal kernel
(``is_causal``, the masked half of ``m x m`` skipped), but a prefill after a
cached prefix has ``q_len != kv_len`` and gets an explicit ``m x n`` mask, so
the whole rectangle is computed. On a CPU a cached 83-token scaffold then makes
a 2048-token prefill ~20 % *slower*. ``h`` prices that path; with ``h > 0`` a
cache hit can be predicted slower, as measured (``cache_never_slower = False``).

Decode form: ``tpot_ms = d + e*context_tokens`` (``linear_decode``).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import nnls

from foundation.errors import InvalidInput

DEFAULT_PREFILL_MODEL = "quadratic"
DEFAULT_DECODE_MODEL = "linear_decode"


def _as_tokens(values: ArrayLike, name: str) -> NDArray[np.float64]:
    arr = np.atleast_1d(np.asarray(values, dtype=np.float64))
    if arr.ndim != 1 or not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise InvalidInput(f"{name} must be finite, non-negative token counts", field=name)
    return arr


def weighted_nnls(features: NDArray[np.float64], measured_ms: NDArray[np.float64]) -> NDArray[np.float64]:
    """Non-negative least squares on relative error: ``min sum(((X @ beta) / y - 1)^2), beta >= 0``.

    Args:
        features: ``(N, p)`` float64, non-negative.
        measured_ms: ``(N,)`` float64, strictly positive measurements.

    Returns:
        ``(p,)`` float64 coefficients, all ``>= 0``.

    Columns are scaled to unit norm before ``scipy.optimize.nnls`` (the
    features span ~1 to ~1e8) and the scale is undone afterwards; positive
    scaling keeps the constraint ``beta >= 0`` intact.

    Raises:
        InvalidInput: shapes disagree, fewer rows than coefficients, or a measurement is not > 0.
    """
    y = np.asarray(measured_ms, dtype=np.float64)  # (N,) ms
    x = np.asarray(features, dtype=np.float64)  # (N, p)
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise InvalidInput("features must be (N, p) and measurements (N,)")
    if x.shape[0] < x.shape[1]:
        raise InvalidInput(f"need at least {x.shape[1]} samples to fit, got {x.shape[0]}")
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise InvalidInput("measurements must be finite and > 0 ms")
    a = x / y[:, None]  # (N, p): each row divided by its measurement
    scale = np.linalg.norm(a, axis=0)  # (p,)
    scale[scale == 0] = 1.0
    beta, _ = nnls(a / scale, np.ones_like(y), maxiter=50 * x.shape[1])  # (p,), scaled units
    return np.asarray(beta / scale, dtype=np.float64)  # (p,)


class Predictor:
    """One cost model: named coefficients over features of token counts (ms out).

    Subclasses set ``name``, ``coefficient_names`` and implement :meth:`features`.
    """

    name: ClassVar[str] = ""
    coefficient_names: ClassVar[tuple[str, ...]] = ()
    formula: ClassVar[str] = ""
    cache_never_slower: ClassVar[bool] = True
    #: True when the features need the engine's prefill chunk size (``chunk_tokens``).
    needs_chunk_tokens: ClassVar[bool] = False

    def __init__(self, coefficients: dict[str, float], chunk_tokens: int | None = None) -> None:
        if self.needs_chunk_tokens and (chunk_tokens is None or int(chunk_tokens) < 1):
            raise InvalidInput(f"{self.name} needs the engine's prefill chunk size (chunk_tokens >= 1)")
        self.chunk_tokens = int(chunk_tokens) if chunk_tokens is not None else None
        missing = set(self.coefficient_names) - set(coefficients)
        extra = set(coefficients) - set(self.coefficient_names)
        if missing or extra:
            raise InvalidInput(f"{self.name} needs coefficients {self.coefficient_names}, got "
                               f"{sorted(coefficients)}")
        if any(not np.isfinite(v) or v < 0 for v in coefficients.values()):
            raise InvalidInput(f"{self.name} coefficients must be finite and >= 0")
        self.coefficients = {k: float(coefficients[k]) for k in self.coefficient_names}
        self._beta = np.array([self.coefficients[k] for k in self.coefficient_names])  # (p,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.coefficients})"


class PrefillPredictor(Predictor):
    """A prefill (TTFT) cost model over ``(prompt_tokens, cached_tokens)``.

    ``prefix_tokens`` (optional everywhere, default ``cached_tokens``) is the scaffold
    boundary the engine chunks at; only forms with ``needs_chunk_tokens`` read it. A cache
    miss on a ``P``-token scaffold is ``(n, c=0, prefix=P)``.
    """

    @classmethod
    def features(cls, prompt_tokens: ArrayLike, cached_tokens: ArrayLike,
                 prefix_tokens: ArrayLike | None = None,
                 chunk_tokens: int | None = None) -> NDArray[np.float64]:
        """``(N, p)`` features for ``N`` prompts (``cached_tokens <= prompt_tokens``).

        Raises:
            InvalidInput: negative counts, more cached than prompt tokens, a prefix outside
                ``[cached, prompt]``, or a chunked form without ``chunk_tokens``.
        """
        n = _as_tokens(prompt_tokens, "prompt_tokens")
        c = _as_tokens(cached_tokens, "cached_tokens")
        n, c = np.broadcast_arrays(n, c)  # (N,), (N,)
        if np.any(c > n):
            raise InvalidInput("cached_tokens cannot exceed prompt_tokens")
        if not cls.needs_chunk_tokens:
            return cls._features(n, c, n - c)
        if chunk_tokens is None or chunk_tokens < 1:
            raise InvalidInput(f"{cls.name} needs the engine's prefill chunk size (chunk_tokens >= 1)")
        p = c if prefix_tokens is None else np.broadcast_to(_as_tokens(prefix_tokens, "prefix_tokens"),
                                                            n.shape)  # (N,)
        q = forward_passes(n, c, p, chunk_tokens)  # (N,)
        return cls._chunk_features(n, c, n - c, q)

    @classmethod
    def _features(cls, n: NDArray[np.float64], c: NDArray[np.float64],
                  m: NDArray[np.float64]) -> NDArray[np.float64]:
        raise NotImplementedError

    @classmethod
    def _chunk_features(cls, n: NDArray[np.float64], c: NDArray[np.float64], m: NDArray[np.float64],
                        q: NDArray[np.float64]) -> NDArray[np.float64]:
        raise NotImplementedError

    def predict_ms(self, prompt_tokens: ArrayLike, cached_tokens: ArrayLike,
                   prefix_tokens: ArrayLike | None = None) -> NDArray[np.float64]:
        """Point prediction in ms, shape ``(N,)``."""
        x = self.features(prompt_tokens, cached_tokens, prefix_tokens, self.chunk_tokens)  # (N, p)
        return np.asarray(x @ self._beta, dtype=np.float64)  # (N,)

    @classmethod
    def fit(cls, prompt_tokens: ArrayLike, cached_tokens: ArrayLike, ttft_ms: ArrayLike,
            chunk_tokens: int | None = None) -> PrefillPredictor:
        """Fit by relative-error NNLS (:func:`weighted_nnls`) to measured TTFTs in ms.

        The samples are timed with the prefix boundary at ``cached_tokens`` (a hit, or no
        scaffold), which is how calibration times them.
        """
        beta = weighted_nnls(cls.features(prompt_tokens, cached_tokens, None, chunk_tokens),
                             np.asarray(ttft_ms, dtype=np.float64))
        return cls(dict(zip(cls.coefficient_names, beta.tolist(), strict=True)),
                   chunk_tokens if cls.needs_chunk_tokens else None)


def forward_passes(n: NDArray[np.float64], c: NDArray[np.float64], p: NDArray[np.float64],
                   chunk_tokens: int) -> NDArray[np.float64]:
    """Forward passes the chunked engine runs to prefill, shape ``(N,)``.

    ``q = ceil((p - c)/S) + ceil((n - max(p, c))/S)``: the scaffold ``[0, p)`` (the part
    of it not cached) in chunks of ``S`` from 0, the rest from ``max(p, c)``
    (``generation.scheduler.Sequence.next_chunk``).

    Raises:
        InvalidInput: a prefix outside ``[cached, prompt]``.
    """
    if np.any(p > n) or np.any(p < c):
        raise InvalidInput("prefix_tokens must lie between cached_tokens and prompt_tokens")
    s = float(chunk_tokens)
    return np.ceil((p - c) / s) + np.ceil((n - np.maximum(p, c)) / s)


class LinearPrefill(PrefillPredictor):
    """``ttft_ms = a + b*m`` (m = computed tokens): a fixed cost plus per-token linear layers;
    ignores attention's growth with context."""

    name = "linear"
    coefficient_names = ("a", "b")
    formula = "a + b*m"

    @classmethod
    def _features(cls, n: NDArray[np.float64], c: NDArray[np.float64],
                  m: NDArray[np.float64]) -> NDArray[np.float64]:
        return np.column_stack([np.ones_like(m), m])  # (N, 2)


class QuadraticPrefill(PrefillPredictor):
    """``ttft_ms = a + b*m + g*m*(n + c)``: adds attention, each of the m computed tokens
    attending to about (n + c)/2 keys (DistServe's ``a + b*L + c*L^2``, extended to a prefix
    cache, docs/latency_model.md "The model"). The default form."""

    name = "quadratic"
    coefficient_names = ("a", "b", "g")
    formula = "a + b*m + g*m*(n + c)"

    @classmethod
    def _features(cls, n: NDArray[np.float64], c: NDArray[np.float64],
                  m: NDArray[np.float64]) -> NDArray[np.float64]:
        return np.column_stack([np.ones_like(m), m, m * (n + c)])  # (N, 3)


class QuadraticSplitPrefill(PrefillPredictor):
    """``ttft_ms = a + b*m + g*m*(n + c) + h*m^2``: the quadratic form plus a separate price
    for the computed tokens' causal self-attention."""

    name = "quadratic_split"
    coefficient_names = ("a", "b", "g", "h")
    formula = "a + b*m + g*m*(n + c) + h*m^2"

    @classmethod
    def _features(cls, n: NDArray[np.float64], c: NDArray[np.float64],
                  m: NDArray[np.float64]) -> NDArray[np.float64]:
        return np.column_stack([np.ones_like(m), m, m * (n + c), m * m])  # (N, 4)


class TwoPathPrefill(PrefillPredictor):
    """``ttft_ms = a + b*m + g*m*(n + c) + h*[c > 0]*m*n``: the quadratic form plus the cost of
    the explicit ``m x n`` attention mask a prefill after a cached prefix gets (SDPA's causal
    kernel only runs without a cache; see the module docstring), so a cache hit may be
    predicted slower (``cache_never_slower = False``)."""

    name = "two_path"
    coefficient_names = ("a", "b", "g", "h")
    formula = "a + b*m + g*m*(n + c) + h*[c > 0]*m*n"
    cache_never_slower = False

    @classmethod
    def _features(cls, n: NDArray[np.float64], c: NDArray[np.float64],
                  m: NDArray[np.float64]) -> NDArray[np.float64]:
        return np.column_stack([np.ones_like(m), m, m * (n + c), (c > 0) * m * n])  # (N, 4)


class ChunkedPrefill(PrefillPredictor):
    """``ttft_ms = a + k*q + b*m + g*m*(n + c)``: the quadratic form plus a fixed cost ``k`` per
    forward pass of the chunked engine (``q`` = :func:`forward_passes`, which needs the
    engine's chunk size). The physically right form for ``generation.scheduler``: a cache
    miss pays one pass more than a hit (the scaffold's own chunk)."""

    name = "chunked"
    coefficient_names = ("a", "k", "b", "g")
    formula = "a + k*q + b*m + g*m*(n + c), q = forward passes"
    needs_chunk_tokens = True

    @classmethod
    def _chunk_features(cls, n: NDArray[np.float64], c: NDArray[np.float64], m: NDArray[np.float64],
                        q: NDArray[np.float64]) -> NDArray[np.float64]:
        return np.column_stack([np.ones_like(m), q, m, m * (n + c)])  # (N, 4)


class DecodePredictor(Predictor):
    """A decode (TPOT) cost model over the context length."""

    @classmethod
    def features(cls, context_tokens: ArrayLike) -> NDArray[np.float64]:
        """``(N, p)`` features of ``N`` context lengths."""
        return cls._features(_as_tokens(context_tokens, "context_tokens"))

    @classmethod
    def _features(cls, ctx: NDArray[np.float64]) -> NDArray[np.float64]:
        raise NotImplementedError

    def predict_ms(self, context_tokens: ArrayLike) -> NDArray[np.float64]:
        """Point prediction of one decode step in ms, shape ``(N,)``."""
        # (N, p) @ (p,) -> (N,)
        return np.asarray(self.features(context_tokens) @ self._beta, dtype=np.float64)

    @classmethod
    def fit(cls, context_tokens: ArrayLike, tpot_ms: ArrayLike) -> DecodePredictor:
        """Fit by relative-error NNLS to measured decode-step times in ms."""
        beta = weighted_nnls(cls.features(context_tokens), np.asarray(tpot_ms, dtype=np.float64))
        return cls(dict(zip(cls.coefficient_names, beta.tolist(), strict=True)))


class LinearDecode(DecodePredictor):
    """``tpot_ms = d + e*context``: one decode step, a fixed cost (weights read once per
    token) plus attention over the ``context`` tokens in the KV cache."""

    name = "linear_decode"
    coefficient_names = ("d", "e")
    formula = "d + e*context"

    @classmethod
    def _features(cls, ctx: NDArray[np.float64]) -> NDArray[np.float64]:
        return np.column_stack([np.ones_like(ctx), ctx])  # (N, 2)


PREFILL_MODELS: dict[str, type[PrefillPredictor]] = {
    cls.name: cls for cls in (LinearPrefill, QuadraticPrefill, QuadraticSplitPrefill, TwoPathPrefill,
                              ChunkedPrefill)
}
DECODE_MODELS: dict[str, type[DecodePredictor]] = {LinearDecode.name: LinearDecode}


def prefill_model(name: str) -> type[PrefillPredictor]:
    """The prefill predictor class registered as ``name``.

    Raises:
        InvalidInput: unknown name.
    """
    try:
        return PREFILL_MODELS[name]
    except KeyError:
        raise InvalidInput(f"unknown prefill model {name!r}; known: {sorted(PREFILL_MODELS)}") from None


def decode_model(name: str) -> type[DecodePredictor]:
    """The decode predictor class registered as ``name``.

    Raises:
        InvalidInput: unknown name.
    """
    try:
        return DECODE_MODELS[name]
    except KeyError:
        raise InvalidInput(f"unknown decode model {name!r}; known: {sorted(DECODE_MODELS)}") from None
