"""Compute precision of the local engine's linear layers: fp32, bf16 in fixed row tiles, or int8.

``fp32`` (the default) leaves the model as transformers loads it: every ``nn.Linear`` is an
fp32 GEMM (MKL sgemm on CPU).

``bf16`` replaces every ``nn.Linear`` of the model (q/k/v/o, gate/up/down, the LM head) by a
:class:`generation.tiled_linear.TiledBF16Linear`: its weight converted to bf16 once, at
load; each call casts the input rows to bf16 and computes them in GEMMs of exactly
``tile_rows`` rows (the last tile zero-padded), oneDNN's bf16 kernel (AVX512-BF16 / AMX)
accumulating in fp32 inside the kernel; the bf16 output is widened back to fp32 (torch has no
fp32-output bf16 GEMM on CPU). Everything else (embeddings, norms, rotary
embeddings, attention, softmax, the residual stream, sampling) stays fp32.

Why fixed tiles: oneDNN chooses its bf16 kernel (and K blocking) by the row count ``M``, so a
plain bf16 GEMM gives a row different bits at ``M`` = 16-32 than at 40+ (docs/precision.md,
measured with ``benchmarks/precision.py``): an answer's bits would depend on its batch mates.
With one GEMM shape ``(T, K) x (K, N)`` per layer a row's bits depend only on its own input:
measured bit-identical for every ``M`` in 1..264 at ``T`` = 128 and 256 on all SmolLM2-135M
shapes, and pinned by ``tests/generation/test_precision.py`` for ``M`` = 1..300.

bf16 needs the CPU's bf16 instructions (``avx512_bf16`` or ``amx_bf16`` in
``/proc/cpuinfo``); without them oneDNN would emulate bf16 slower than fp32, so it is refused
at start (:func:`check_precision`).

``int8`` (w8a8) replaces every ``nn.Linear`` by a :class:`generation.tiled_linear.Int8Linear`:
weights quantised once, per output channel (symmetric int8), activations per row at each call
(dynamic, the row's own scale), an int8 x int8 -> int32 GEMM (``torch._int_mm``, oneDNN's
s8s8s32 kernel, VNNI), then ``acc * row scale * column scale`` in fp32. Integer sums are exact,
so a row's bits never depend on how many rows share the GEMM: no tiles and no row padding
(the engine runs int8 steps unpadded, ``row_padding: none`` in the identity). It needs
the CPU's VNNI dot products (``avx512_vnni``, ``avx_vnni`` or ``amx_int8``; without them
oneDNN's int8 path goes through ``vpmaddubsw``, whose int16 sums saturate and are not exact)
and a ``torch._int_mm`` that returns the exact product (probed at load,
:func:`check_int8_kernel`).

``int8a16`` is int8 with each activation row in two int8 passes (the row's int8 values, then
its rounding residue at 1/254 of a step, ~15 bits; ``Int8Linear(act_passes=2)``): twice the
GEMMs, the same exactness, and the quality of int8 weights alone (docs/precision.md: w8a8
fails the quality guard, w8a16 passes its NLL part).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from foundation.errors import InvalidConfig

#: The precisions the local engine offers (``RAGBUDGET_GENERATOR_PRECISION``).
PRECISIONS = ("fp32", "bf16", "int8", "int8a16")
#: The integer precisions: ``int8`` (w8a8) and ``int8a16`` (int8 weights, each activation row
#: in two int8 passes, ~15 bits; twice the GEMMs, exact sums too).
INT8_PRECISIONS = ("int8", "int8a16")
#: Rows per bf16 GEMM tile: 128 measured invariant for M = 1..264 and 2.0-2.8x fp32 per GEMM at
#: 256 rows on the 2-core Xeon of docs/precision.md (``T`` = 256 is faster still at 256+ rows
#: but costs twice the work of a 1-answer decode step).
DEFAULT_TILE_ROWS = 128
#: ``/proc/cpuinfo`` flags that give native bf16 dot products (either suffices for oneDNN).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: ``/proc/cpuinfo`` flags of non-saturating int8 dot products (VNNI ``vpdpbusd`` or AMX), any one.
INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
#: The names the integer precisions go by (int32 accumulation).
INT8_LABEL = "int8-w8a8"
INT8A16_LABEL = "int8-w8a16"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU feature flags of the first ``flags`` line of ``cpuinfo`` (empty when unreadable)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_supported(flags: set[str] | None = None) -> bool:
    """True when the CPU has native bf16 (``avx512_bf16`` or ``amx_bf16``)."""
    return bool(set(BF16_FLAGS) & (cpu_flags() if flags is None else flags))


def int8_supported(flags: set[str] | None = None) -> bool:
    """True when the CPU has non-saturating int8 dot products (one of :data:`INT8_FLAGS`)."""
    return bool(set(INT8_FLAGS) & (cpu_flags() if flags is None else flags))


def precision_label(precision: str, tile_rows: int = DEFAULT_TILE_ROWS) -> str:
    """The name a precision goes by in the generator identity: ``fp32``, ``bf16-tile<T>`` or
    ``int8-w8a8`` (:data:`INT8_LABEL`; int8 has no tiles)."""
    if precision == "int8":
        return INT8_LABEL
    if precision == "int8a16":
        return INT8A16_LABEL
    return "fp32" if precision == "fp32" else f"{precision}-tile{tile_rows}"


def pads_rows(precision: str) -> bool:
    """Whether the engine pads a step's rows (``padded_rows``) in ``precision``: True for fp32
    (MKL sgemm picks kernels by row count) and bf16 (kept as measured), False for int8 (exact
    integer GEMMs, row-wise everything else; :mod:`generation.tiled_linear`)."""
    return precision not in INT8_PRECISIONS


def check_int8_kernel() -> None:
    """Refuse int8 where ``torch._int_mm`` is missing or not exact on this build and CPU.

    Imports torch (call it where the model is loaded anyway).

    Raises:
        InvalidConfig: :func:`generation.tiled_linear.int8_kernel_exact` is False.
    """
    from generation.tiled_linear import int8_kernel_exact

    if not int8_kernel_exact():
        raise InvalidConfig("generator_precision=int8 needs torch._int_mm with an exact int32 "
                            "result on this CPU (missing or not exact here); use "
                            "generator_precision=fp32", field="generator_precision")


def check_precision(precision: str, device: str, dtype: str, tile_rows: int = DEFAULT_TILE_ROWS,
                    flags: set[str] | None = None) -> None:
    """Refuse a precision this process cannot run.

    Args:
        precision: ``fp32``, ``bf16`` or ``int8``.
        device, dtype: as resolved by :func:`generation.local.resolve_device_dtype`.
        tile_rows: rows per bf16 GEMM tile (>= 1).
        flags: CPU flags (default: read from ``/proc/cpuinfo``).

    Raises:
        InvalidConfig: an unknown precision; ``bf16`` on a device other than the CPU (a GPU
            runs bf16 through ``generator_dtype=bfloat16``), with a model dtype other than
            float32, with ``tile_rows < 1``, or on a CPU without ``avx512_bf16``/``amx_bf16``;
            ``int8`` likewise off the CPU, with a non-fp32 model, or on a CPU without any of
            :data:`INT8_FLAGS` (the kernel itself is probed at load, :func:`check_int8_kernel`).
    """
    if precision not in PRECISIONS:
        raise InvalidConfig(f"unknown generator precision {precision!r}; one of {', '.join(PRECISIONS)}",
                            field="generator_precision")
    if precision == "fp32":
        return
    if device != "cpu":
        raise InvalidConfig(f"generator_precision={precision} is for the CPU; on {device} set "
                            "generator_dtype=bfloat16 instead", field="generator_precision")
    if dtype != "float32":
        raise InvalidConfig(f"generator_precision={precision} converts an fp32 model's linear layers; "
                            f"generator_dtype={dtype} must be float32 (or auto)", field="generator_precision")
    if precision in INT8_PRECISIONS:
        if not int8_supported(flags):
            raise InvalidConfig(f"generator_precision={precision} needs a CPU with {' or '.join(INT8_FLAGS)} "
                                "(not in /proc/cpuinfo flags); use generator_precision=fp32",
                                field="generator_precision")
        return
    if tile_rows < 1:
        raise InvalidConfig("generator_tile_rows must be >= 1", field="generator_tile_rows")
    if not bf16_supported(flags):
        raise InvalidConfig(f"generator_precision={precision} needs a CPU with {' or '.join(BF16_FLAGS)} "
                            "(not in /proc/cpuinfo flags); use generator_precision=fp32",
                            field="generator_precision")


def apply_precision(model: Any, precision: str, tile_rows: int = DEFAULT_TILE_ROWS) -> int:
    """Switch ``model``'s linear layers to ``precision`` in place; how many were replaced.

    ``fp32`` changes nothing (0). ``bf16`` replaces every ``torch.nn.Linear`` submodule
    (the LM head included; a head tied to the input embedding gets its own bf16 copy, the
    embedding stays fp32) by a :class:`generation.tiled_linear.TiledBF16Linear`; ``int8`` by a
    :class:`generation.tiled_linear.Int8Linear` (the same way); the fp32 weights of untied
    layers are released with the modules. Call once, right after loading,
    before any forward.

    Raises:
        InvalidConfig: an unknown precision.
    """
    import torch

    from generation.tiled_linear import Int8Linear, TiledBF16Linear

    if precision not in PRECISIONS:
        raise InvalidConfig(f"unknown generator precision {precision!r}", field="generator_precision")
    if precision == "fp32":
        return 0
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Int8Linear(mod, 2 if precision == "int8a16" else 1)
                if precision in INT8_PRECISIONS else TiledBF16Linear(mod, tile_rows))
    return len(targets)
