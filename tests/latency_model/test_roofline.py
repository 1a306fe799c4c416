"""Roofline priors: datasheet lookup, config parsing, coefficients, prior labelling."""

from __future__ import annotations

import pytest

from foundation.errors import InvalidConfig
from latency_model.roofline import (
    ModelShape,
    build_prior,
    datasheet_peaks,
    lookup_device,
    roofline_coefficients,
)

SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
           "tie_word_embeddings": True}
GPU_IDENTITY = {"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3", "model_id": "m",
                "weights_hash": "sha256:" + "0" * 64, "dtype": "bfloat16", "threads": 8,
                "context_window": 8192, "backend": "local"}


@pytest.mark.parametrize(("name", "expected"), [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"), ("NVIDIA H200", "NVIDIA H200 SXM"),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB SXM"), ("NVIDIA L40S", "NVIDIA L40S"),
    ("NVIDIA L4", "NVIDIA L4"),
])
def test_datasheet_lookup_matches_real_device_names(name: str, expected: str) -> None:
    spec = lookup_device(name)
    assert spec is not None and spec.name == expected


def test_unknown_gpu_has_no_datasheet_entry() -> None:
    assert lookup_device("NVIDIA GeForce GTX 1080") is None
    with pytest.raises(InvalidConfig):
        datasheet_peaks("NVIDIA GeForce GTX 1080", "bfloat16")


def test_fp32_uses_the_non_tensor_peak() -> None:
    assert datasheet_peaks("NVIDIA L4", "float32")[0] == pytest.approx(30.3e12)
    assert datasheet_peaks("NVIDIA L4", "bfloat16")[0] == pytest.approx(121e12)


def test_smollm2_parameter_count_is_about_135m() -> None:
    shape = ModelShape.from_config(SMOLLM2)
    assert 130e6 < shape.total_params < 140e6


def test_missing_config_field_is_invalid_config() -> None:
    with pytest.raises(InvalidConfig):
        ModelShape.from_config({"hidden_size": 8})


def test_attention_coefficient_follows_flop_count() -> None:
    shape = ModelShape.from_config(SMOLLM2)
    prefill, _ = roofline_coefficients(shape, peak_flops=1e12, bandwidth_bytes_s=1e11,
                                       dtype_bytes=4, kind="cuda")
    # 2 * L * H * d FLOP per unit of m*(n + c), at half of 1e12 FLOP/s, in ms.
    assert prefill["g"] == pytest.approx(2 * 30 * 9 * 64 / (0.5e12 / 1e3))


def test_prior_is_labelled_prior_with_a_wide_band() -> None:
    peaks = datasheet_peaks("NVIDIA H100 80GB HBM3", "bfloat16")
    prior = build_prior(GPU_IDENTITY, SMOLLM2, peak_flops=peaks[0], bandwidth_bytes_s=peaks[1],
                        peaks_source=peaks[2], created_at="2026-01-01T00:00:00+00:00")
    assert prior.source == "prior" and prior.threads is None
    assert prior.prefill_quantiles["p95"] >= 1.0
    assert prior.prior is not None and "H100" in prior.prior["peaks_source"]
    p50, p95 = prior.predict_ttft_ms(2000, 0)
    assert 0 < p50 < p95


def test_faster_device_gets_a_faster_prior() -> None:
    def ttft(device_name: str) -> float:
        flops, bw, src = datasheet_peaks(device_name, "bfloat16")
        ident = dict(GPU_IDENTITY, device_name=device_name)
        prior = build_prior(ident, SMOLLM2, peak_flops=flops, bandwidth_bytes_s=bw, peaks_source=src,
                            created_at="2026-01-01T00:00:00+00:00")
        return prior.predict_ttft_ms(4000, 0)[0]

    assert ttft("NVIDIA H100 80GB HBM3") < ttft("NVIDIA L4")


def test_cpu_probe_reports_a_peak_at_least_the_measured_rates() -> None:
    from latency_model.probe import probe_cpu

    r = probe_cpu(2, matmul_n=128, copy_mib=4, repeats=3)
    assert r["peak_flops"] >= r["flops_threads"] > 0
    assert r["peak_flops"] >= 2 * r["flops_one_thread"] * 0.999
    assert r["bandwidth_bytes_s"] > 0 and "cpu probe" in r["source"]
