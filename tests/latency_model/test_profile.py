"""Profiles: content-addressed id, bit-for-bit JSON round trip, integrity, p50/p95 predictions."""

from __future__ import annotations

import json

import pytest

from foundation.errors import IntegrityFailure, InvalidInput
from foundation.hashing import is_tagged_hash
from latency_model.profile import Profile


def test_json_round_trip_is_bit_for_bit(fitted_profile: Profile) -> None:
    text = fitted_profile.to_json()
    again = Profile.from_json(text)
    assert again == fitted_profile
    assert again.to_json() == text


def test_id_is_a_tagged_hash_of_the_content(fitted_profile: Profile) -> None:
    assert is_tagged_hash(fitted_profile.id)
    assert is_tagged_hash(fitted_profile.samples_hash)


def test_tampered_coefficient_fails_verification(fitted_profile: Profile) -> None:
    body = json.loads(fitted_profile.to_json())
    body["prefill_coefficients"]["a"] *= 0.5
    with pytest.raises(IntegrityFailure):
        Profile.from_dict(body)


def test_tampered_sample_fails_verification(fitted_profile: Profile) -> None:
    body = json.loads(fitted_profile.to_json())
    body["samples"]["prefill"][0][2] += 1.0
    with pytest.raises(IntegrityFailure):
        Profile.from_dict(body)


def test_unknown_field_is_invalid_input(fitted_profile: Profile) -> None:
    body = json.loads(fitted_profile.to_json())
    body["surprise"] = 1
    with pytest.raises(InvalidInput):
        Profile.from_dict(body)


def test_p95_is_never_below_p50(fitted_profile: Profile) -> None:
    for n, c in ((8, 0), (300, 200), (2000, 0), (6000, 200)):
        p50, p95 = fitted_profile.predict_ttft_ms(n, c)
        assert 0 < p50 <= p95


def test_cached_prefix_never_predicts_slower(fitted_profile: Profile) -> None:
    uncached = fitted_profile.predict_ttft_ms(1200, 0)
    cached = fitted_profile.predict_ttft_ms(1200, 200)
    assert cached[0] <= uncached[0] and cached[1] <= uncached[1]


def test_key_includes_threads_only_on_cpu(fitted_profile: Profile) -> None:
    assert fitted_profile.key[-1] == 2
    assert fitted_profile.key[:4] == ("Fake CPU 9000", "fake/model-135m",
                                      "sha256:" + "ab" * 32, "float32")


def test_decode_prediction_grows_with_context(fitted_profile: Profile) -> None:
    assert fitted_profile.predict_tpot_ms(4000) > fitted_profile.predict_tpot_ms(100) > 0


def test_summary_leaves_out_the_raw_samples(fitted_profile: Profile) -> None:
    summary = fitted_profile.summary()
    assert "samples" not in summary and summary["samples_hash"] == fitted_profile.samples_hash


def test_absolute_band_lifts_short_prompts_and_keeps_p95_monotone(fitted_profile: Profile) -> None:
    import dataclasses

    import numpy as np

    body = {f.name: getattr(fitted_profile, f.name) for f in dataclasses.fields(fitted_profile)}
    body["prefill_abs_quantiles_ms"] = {"p50": 0.0, "p95": 25.0}
    widened = Profile.create(**body)
    point = float(widened.prefill_predictor.predict_ms([10], [0])[0])
    assert widened.predict_ttft_ms(10, 0)[1] >= point + 25.0
    n = np.arange(1, 3000, dtype=float)
    p95 = widened.predict_ttft_many(n, np.zeros_like(n))[1]
    assert np.all(np.diff(p95) >= 0)


def test_profile_written_before_a_late_field_keeps_its_id_and_bytes() -> None:
    from pathlib import Path

    text = (Path(__file__).parent / "data" / "profile_v1_before_abs_band.json").read_text().strip()
    profile = Profile.from_json(text)
    assert profile.prefill_abs_quantiles_ms == {}
    assert profile.to_json() == text
