"""Prefill/decode predictors: exact recovery, monotonicity, cache never slower, registry."""

from __future__ import annotations

import numpy as np
import pytest

from foundation.errors import InvalidInput
from latency_model.predictors import (
    PREFILL_MODELS,
    ChunkedPrefill,
    LinearDecode,
    QuadraticPrefill,
    QuadraticSplitPrefill,
    TwoPathPrefill,
    decode_model,
    forward_passes,
    prefill_model,
)

GRID_N = np.array([8, 32, 96, 256, 512, 1024, 2048, 300, 700, 1500, 4096], dtype=float)
GRID_C = np.array([0, 0, 0, 0, 0, 0, 0, 200, 200, 200, 1000], dtype=float)


def test_quadratic_recovers_known_coefficients_from_noiseless_data() -> None:
    truth = QuadraticPrefill({"a": 12.0, "b": 0.9, "g": 2.5e-5})
    fitted = QuadraticPrefill.fit(GRID_N, GRID_C, truth.predict_ms(GRID_N, GRID_C))
    for name, value in truth.coefficients.items():
        assert fitted.coefficients[name] == pytest.approx(value, rel=1e-9)


def test_split_form_recovers_its_extra_term_from_noiseless_data() -> None:
    truth = QuadraticSplitPrefill({"a": 3.0, "b": 0.5, "g": 1e-5, "h": 4e-5})
    fitted = QuadraticSplitPrefill.fit(GRID_N, GRID_C, truth.predict_ms(GRID_N, GRID_C))
    for name, value in truth.coefficients.items():
        assert fitted.coefficients[name] == pytest.approx(value, rel=1e-8)


def test_decode_recovers_known_coefficients_from_noiseless_data() -> None:
    ctx = np.array([16, 256, 1024, 2048, 8192], dtype=float)
    truth = LinearDecode({"d": 20.0, "e": 0.004})
    fitted = LinearDecode.fit(ctx, truth.predict_ms(ctx))
    assert fitted.coefficients["d"] == pytest.approx(20.0, rel=1e-9)
    assert fitted.coefficients["e"] == pytest.approx(0.004, rel=1e-9)


def test_fit_never_returns_negative_coefficients() -> None:
    # Times that fall with length would need b < 0; NNLS clamps instead.
    y = 1000.0 / np.sqrt(GRID_N)
    fitted = QuadraticPrefill.fit(GRID_N, GRID_C, y)
    assert min(fitted.coefficients.values()) >= 0.0


@pytest.mark.parametrize("name", sorted(PREFILL_MODELS))
def test_prediction_is_monotone_in_computed_tokens(name: str) -> None:
    cls = PREFILL_MODELS[name]
    rng = np.random.default_rng(0)
    for _ in range(20):
        pred = cls(dict(zip(cls.coefficient_names, rng.uniform(0, 1, len(cls.coefficient_names)) *
                            np.array([10, 1, 1e-4, 1e-4][: len(cls.coefficient_names)]), strict=True)),
                   256 if cls.needs_chunk_tokens else None)
        for cached in (0, 100, 1000):
            m = np.arange(1, 3000, 37, dtype=float)
            p = pred.predict_ms(m + cached, np.full_like(m, cached))
            assert np.all(np.diff(p) >= 0)


@pytest.mark.parametrize("name", sorted(n for n, c in PREFILL_MODELS.items() if c.cache_never_slower))
def test_cached_tokens_never_make_a_prediction_slower(name: str) -> None:
    cls = PREFILL_MODELS[name]
    pred = cls(dict(zip(cls.coefficient_names, [5.0, 0.7, 3e-5, 2e-5][: len(cls.coefficient_names)],
                        strict=True)), 256 if cls.needs_chunk_tokens else None)
    for n in (16, 500, 4000):
        c = np.arange(0, n + 1, dtype=float)
        p = pred.predict_ms(np.full_like(c, n), c)
        assert np.all(np.diff(p) <= 1e-12)


def test_more_cached_than_prompt_tokens_is_invalid() -> None:
    with pytest.raises(InvalidInput):
        QuadraticPrefill.features([10], [11])


def test_negative_coefficients_are_rejected() -> None:
    with pytest.raises(InvalidInput):
        QuadraticPrefill({"a": 1.0, "b": -0.1, "g": 0.0})


def test_unknown_model_names_are_invalid_input() -> None:
    with pytest.raises(InvalidInput):
        prefill_model("cubic")
    with pytest.raises(InvalidInput):
        decode_model("quadratic")


def test_fit_rejects_non_positive_measurements() -> None:
    with pytest.raises(InvalidInput):
        QuadraticPrefill.fit([8, 16, 32], [0, 0, 0], [1.0, 0.0, 3.0])


def test_only_two_path_may_predict_a_slower_cache_hit() -> None:
    assert [n for n, c in PREFILL_MODELS.items() if not c.cache_never_slower] == ["two_path"]


def test_two_path_prices_the_masked_attention_of_a_cache_hit() -> None:
    # Coefficients of the same order as measured on the 2-core CPU: a long prompt after a short
    # cached scaffold is slower than without it, a short one is faster.
    pred = TwoPathPrefill({"a": 48.0, "b": 1.12, "g": 2.9e-4, "h": 1.5e-4})
    long_uncached, long_cached = pred.predict_ms([2048, 2048], [0, 83])
    short_uncached, short_cached = pred.predict_ms([200, 200], [0, 83])
    assert long_cached > long_uncached
    assert short_cached < short_uncached


def test_two_path_recovers_its_coefficients_from_noiseless_data() -> None:
    truth = TwoPathPrefill({"a": 48.0, "b": 1.12, "g": 2.9e-4, "h": 1.5e-4})
    fitted = TwoPathPrefill.fit(GRID_N, GRID_C, truth.predict_ms(GRID_N, GRID_C))
    for name, value in truth.coefficients.items():
        assert fitted.coefficients[name] == pytest.approx(value, rel=1e-8)


def test_forward_passes_follow_the_engines_chunk_boundaries() -> None:
    n = np.array([100.0, 300.0, 300.0, 300.0, 1100.0, 1100.0, 83.0])
    c = np.array([83.0, 83.0, 0.0, 0.0, 83.0, 0.0, 83.0])
    p = np.array([83.0, 83.0, 83.0, 0.0, 83.0, 83.0, 83.0])
    # hit: the rest in chunks from P; miss: the scaffold's own chunk, then the rest; no scaffold
    # from 0; a prompt that is exactly the cached scaffold runs no pass.
    assert forward_passes(n, c, p, 256).tolist() == [1, 1, 2, 2, 4, 5, 0]


def test_chunked_form_prices_the_scaffold_chunk_a_miss_adds() -> None:
    truth = ChunkedPrefill({"a": 10.0, "k": 30.0, "b": 1.0, "g": 4e-4}, chunk_tokens=256)
    for n in (100.0, 500.0, 2000.0):
        miss = truth.predict_ms([n], [0], [83])[0]
        hit = truth.predict_ms([n], [83])[0]
        assert miss - hit == pytest.approx(30.0 + 83.0 + 4e-4 * 83.0 ** 2)


def test_chunked_form_needs_the_chunk_size() -> None:
    with pytest.raises(InvalidInput):
        ChunkedPrefill({"a": 1.0, "k": 1.0, "b": 1.0, "g": 0.0})
    with pytest.raises(InvalidInput):
        ChunkedPrefill.features([100], [0])


def test_chunked_form_recovers_its_coefficients_from_noiseless_data() -> None:
    n = np.repeat([8, 45, 160, 251, 301, 512, 765, 1024, 1101, 1531, 2047], 2).astype(float)
    c = np.tile([0.0, 83.0], n.size // 2)
    c[n <= 83] = 0.0
    truth = ChunkedPrefill({"a": 10.0, "k": 30.0, "b": 1.0, "g": 4e-4}, chunk_tokens=256)
    fitted = ChunkedPrefill.fit(n, c, truth.predict_ms(n, c), chunk_tokens=256)
    for name, value in truth.coefficients.items():
        assert fitted.coefficients[name] == pytest.approx(value, rel=1e-8)
