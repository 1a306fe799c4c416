"""Roofline priors: a first guess at prefill and decode cost for a device with no fitted profile.

The prior fills the same forms as a fitted profile (``quadratic`` prefill,
``linear_decode``) from the model config and the device's peak FLOP/s and
memory bandwidth, adding the compute-bound and memory-bound terms (an upper
roofline bound; Williams et al., CACM 2009):

* linear layers: ``2 * P_layers`` FLOP per computed token, ``P_layers`` the
  non-embedding parameters (q, k, v, o projections and the MLP) -> ``b``;
* attention: query token ``i`` of ``m`` attends ``c + i`` keys with ``4*d``
  FLOP per key and head, ``sum = m*(n + c)/2`` keys, so
  ``2 * L * H * d * m*(n + c)`` FLOP -> ``g``;
* fixed cost: reading every weight once (``bytes / bandwidth``), the LM head
  on the last token only, and a per-layer launch/dispatch overhead -> ``a``;
* decode step: weights once plus the KV cache (``2 * L * H_kv * d`` values
  per context token) over bandwidth -> ``d``, ``e``.

FLOP/s are the dense datasheet peaks times an achievable fraction
(:data:`ACHIEVABLE_FRACTION`); a prior is labelled ``source: "prior"``
everywhere and carries a wide residual band (:data:`PRIOR_QUANTILES`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from foundation.errors import InvalidConfig
from latency_model.profile import Profile, profile_dtype


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet peaks of one accelerator (dense, no 2:4 sparsity)."""

    name: str
    pattern: str  # regex matched case-insensitively against the device name
    bf16_tflops: float
    fp32_tflops: float
    bandwidth_gbs: float
    source: str


# NVIDIA datasheets; the tensor-core figures printed "with sparsity" are halved to dense.
DATASHEET: tuple[DeviceSpec, ...] = (
    DeviceSpec("NVIDIA H200 SXM", r"H200", 989.0, 67.0, 4800.0,
               "NVIDIA H200 Tensor Core GPU datasheet (2023): BF16 1,979 TFLOPS with sparsity, "
               "FP32 67 TFLOPS, 4.8 TB/s HBM3e"),
    DeviceSpec("NVIDIA H100 SXM", r"H100", 989.0, 67.0, 3350.0,
               "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM: BF16 1,979 TFLOPS with "
               "sparsity, FP32 67 TFLOPS, 3.35 TB/s HBM3"),
    DeviceSpec("NVIDIA A100 80GB SXM", r"A100", 312.0, 19.5, 2039.0,
               "NVIDIA A100 Tensor Core GPU datasheet (2021), 80GB SXM: BF16 312 TFLOPS dense, "
               "FP32 19.5 TFLOPS, 2,039 GB/s HBM2e"),
    DeviceSpec("NVIDIA L40S", r"L40S", 362.05, 91.6, 864.0,
               "NVIDIA L40S datasheet (2023): BF16 362.05 TFLOPS dense (733 with sparsity), "
               "FP32 91.6 TFLOPS, 864 GB/s GDDR6"),
    DeviceSpec("NVIDIA L4", r"\bL4\b", 121.0, 30.3, 300.0,
               "NVIDIA L4 Tensor Core GPU datasheet (2023): BF16 242 TFLOPS with sparsity, "
               "FP32 30.3 TFLOPS, 300 GB/s GDDR6"),
)

# Fraction of the peak FLOP/s a prefill reaches. GPUs: typical MFU of a well-run prefill
# (~50 %). CPU: the probe already measures an achieved fp32 GEMM rate, and SmolLM2-135M's
# linear layers ran at ~100 % of it on the 2-core EPYC VM (fitted b = 1.05 ms/token for
# 2 * 106 M FLOP/token vs a 180-220 GFLOP/s probe, docs/latency_model.md).
ACHIEVABLE_FRACTION = {"cuda": 0.5, "cpu": 0.9}
# Fixed dispatch cost per transformer layer per forward pass (ms), eager PyTorch. CPU: the same
# run's fitted a = 45 ms for 30 layers, less ~13 ms of weight reads. GPU: ~10 kernel launches of
# ~10-15 us per layer.
LAYER_OVERHEAD_MS = {"cuda": 0.15, "cpu": 1.0}
# A roofline guess is commonly off by up to 2x either way; the band says so.
PRIOR_QUANTILES = {"p05": -0.5, "p50": 0.0, "p90": 0.8, "p95": 1.0, "p99": 2.0}
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
GATED_MLP = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3",
             "smollm3", "olmo", "olmo2", "granite", "cohere", "starcoder2_gated"}


def lookup_device(device_name: str) -> DeviceSpec | None:
    """The datasheet entry whose pattern matches ``device_name`` (e.g. ``"NVIDIA H100 80GB HBM3"``)."""
    for spec in DATASHEET:
        if re.search(spec.pattern, device_name, flags=re.IGNORECASE):
            return spec
    return None


def _cfg(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if config.get(n) is not None:
            return config[n]
    if default is None:
        raise InvalidConfig(f"model config lacks {names[0]!r}; cannot build a roofline prior")
    return default


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer a roofline needs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    tied_embeddings: bool
    context_window: int | None
    num_parameters: int | None = None  # as counted by the model itself, when the caller knows it

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """Read a Hugging Face ``config.json`` dict (Llama/GPT-2 style names).

        Raises:
            InvalidConfig: a required field is missing.
        """
        hidden = int(_cfg(config, "hidden_size", "n_embd", "d_model"))
        heads = int(_cfg(config, "num_attention_heads", "n_head"))
        return cls(
            layers=int(_cfg(config, "num_hidden_layers", "n_layer")),
            hidden=hidden, heads=heads,
            kv_heads=int(_cfg(config, "num_key_value_heads", default=heads)),
            head_dim=int(_cfg(config, "head_dim", default=hidden // heads)),
            intermediate=int(_cfg(config, "intermediate_size", "n_inner", default=4 * hidden)),
            vocab=int(_cfg(config, "vocab_size")),
            gated_mlp=str(config.get("model_type", "")) in GATED_MLP,
            tied_embeddings=bool(config.get("tie_word_embeddings", True)),
            context_window=config.get("max_position_embeddings") or config.get("n_positions"),
            num_parameters=int(config["num_parameters"]) if config.get("num_parameters") else None,
        )

    @property
    def layer_params(self) -> int:
        """Non-embedding parameters (attention projections + MLP) over all layers."""
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.layers * (attn + mlp)

    @property
    def total_params(self) -> int:
        """All parameters the forward pass reads: ``num_parameters`` when given, else counted
        from the shapes (embeddings once, the LM head again if untied)."""
        if self.num_parameters:
            return self.num_parameters
        emb = self.vocab * self.hidden
        return self.layer_params + emb * (1 if self.tied_embeddings else 2)


def roofline_coefficients(shape: ModelShape, *, peak_flops: float, bandwidth_bytes_s: float,
                          dtype_bytes: int, kind: str) -> tuple[dict[str, float], dict[str, float]]:
    """Prior ``(prefill {a, b, g}, decode {d, e})`` coefficients in ms (see module docstring).

    Args:
        peak_flops: peak FLOP/s of the device for the dtype (dense).
        bandwidth_bytes_s: memory bandwidth in bytes/s.
        dtype_bytes: bytes per weight/activation value.
        kind: ``"cuda"`` or ``"cpu"`` (picks the achievable fraction and overheads).

    Raises:
        InvalidConfig: non-positive peaks.
    """
    if peak_flops <= 0 or bandwidth_bytes_s <= 0:
        raise InvalidConfig("peak FLOP/s and bandwidth must be > 0")
    flops = peak_flops * ACHIEVABLE_FRACTION[kind] / 1e3  # FLOP per ms
    bw = bandwidth_bytes_s / 1e3  # bytes per ms
    weights_ms = shape.total_params * dtype_bytes / bw
    lm_head_ms = 2 * shape.hidden * shape.vocab / flops
    overhead_ms = LAYER_OVERHEAD_MS[kind] * shape.layers
    prefill = {
        "a": overhead_ms + weights_ms + lm_head_ms,
        "b": 2 * shape.layer_params / flops,
        "g": 2 * shape.layers * shape.heads * shape.head_dim / flops,
    }
    kv_bytes_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes
    decode = {
        "d": overhead_ms + weights_ms + 2 * shape.total_params / flops,
        "e": kv_bytes_per_token / bw,
    }
    return prefill, decode


def build_prior(identity: dict[str, Any], config: dict[str, Any], *, peak_flops: float,
                bandwidth_bytes_s: float, peaks_source: str, created_at: str,
                software: dict[str, str] | None = None) -> Profile:
    """A ``source="prior"`` :class:`Profile` for ``identity`` from the model config and device peaks.

    Args:
        identity: generator identity (device, device_name, model_id, weights_hash, dtype,
            threads, context_window, backend).
        config: the model's Hugging Face config as a dict.
        peak_flops, bandwidth_bytes_s: device peaks (datasheet or probe).
        peaks_source: where the peaks come from (datasheet citation or "cpu probe ...").
        created_at: ISO timestamp (passed in: the maths reads no clock).

    Raises:
        InvalidConfig: the config lacks a needed field or the peaks are not positive.
    """
    shape = ModelShape.from_config(config)
    device = str(identity.get("device", "cpu"))
    kind = "cuda" if device.startswith("cuda") else "cpu"
    dtype = str(identity.get("dtype", "float32")).replace("torch.", "")
    # the local engine's bf16 precision reads its linear weights in 2 bytes (generation.precision)
    dtype_bytes = 2 if str(identity.get("precision") or "").startswith("bf16") else DTYPE_BYTES.get(dtype, 4)
    prefill, decode = roofline_coefficients(shape, peak_flops=peak_flops,
                                            bandwidth_bytes_s=bandwidth_bytes_s,
                                            dtype_bytes=dtype_bytes, kind=kind)
    context_window = identity.get("context_window") or shape.context_window
    return Profile.create(
        source="prior", created_at=created_at, device=device,
        device_name=str(identity.get("device_name", device)),
        model_id=str(identity.get("model_id", "unknown")),
        weights_hash=str(identity.get("weights_hash", "")), dtype=profile_dtype(identity),
        threads=identity.get("threads") if kind == "cpu" else None,
        backend=str(identity.get("backend", "local")),
        context_window=int(context_window) if context_window else None,
        prefill_model="quadratic", prefill_coefficients=prefill,
        prefill_quantiles=dict(PRIOR_QUANTILES),
        decode_model="linear_decode", decode_coefficients=decode,
        decode_quantiles=dict(PRIOR_QUANTILES),
        software=dict(software or {}),
        prior={"peak_flops": float(peak_flops), "bandwidth_bytes_s": float(bandwidth_bytes_s),
               "peaks_source": peaks_source, "achievable_fraction": ACHIEVABLE_FRACTION[kind],
               "layer_overhead_ms": LAYER_OVERHEAD_MS[kind], "dtype_bytes": dtype_bytes,
               "layer_params": shape.layer_params, "total_params": shape.total_params,
               "layers": shape.layers, "heads": shape.heads, "head_dim": shape.head_dim},
        notes=["roofline prior: not measured on this device; run `ragbudget calibrate` "
               "for a fitted profile", "residual band is a fixed x0.5..x2 (p05..p95)"],
    )


def datasheet_peaks(device_name: str, dtype: str) -> tuple[float, float, str]:
    """``(peak FLOP/s, bandwidth bytes/s, citation)`` for a GPU in :data:`DATASHEET`.

    bf16/fp16 use the dense tensor-core peak; float32 the non-tensor FP32 peak
    (PyTorch does not use TF32 for matmuls by default).

    Raises:
        InvalidConfig: the device is not in the table.
    """
    spec = lookup_device(device_name)
    if spec is None:
        raise InvalidConfig(f"no datasheet entry for device {device_name!r}; known: "
                            f"{', '.join(s.name for s in DATASHEET)}")
    tflops = spec.fp32_tflops if DTYPE_BYTES.get(dtype.replace("torch.", ""), 4) == 4 else spec.bf16_tflops
    return tflops * 1e12, spec.bandwidth_gbs * 1e9, f"{spec.name}: {spec.source}"
