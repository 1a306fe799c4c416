"""The linear layers of the compute precisions (generation.precision): tiled bf16 and int8 w8a8.

Kept apart from :mod:`generation.precision` so that reading settings and checking the CPU
never imports torch.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F


class TiledBF16Linear(torch.nn.Module):
    """``y = x @ W.T + b`` as bf16 GEMMs of exactly ``tile_rows`` rows, fp32 in and out.

    Args:
        linear: the ``nn.Linear`` (weight ``(N, K)``) it replaces; its weight is copied to bf16
            here, once; the bias (if any) is kept in fp32 and added after the GEMM.
        tile_rows: rows per GEMM (``T``; :data:`generation.precision.DEFAULT_TILE_ROWS` is the
            measured default); the last tile of a call is zero-padded to ``T``.

    ``forward(x)``: ``x (..., K)`` float32 -> ``(..., N)`` float32. Row ``i`` of the result
    depends only on row ``i`` of ``x`` (never on how many rows came with it nor on its place in
    a tile): every GEMM has the one shape ``(T, K) x (K, N)`` (module docstring).
    """

    def __init__(self, linear: Any, tile_rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = int(linear.in_features), int(linear.out_features)
        self.tile_rows = int(tile_rows)
        # a frozen parameter (not a buffer), so ``model.num_parameters()`` still counts it
        self.weight = torch.nn.Parameter(linear.weight.detach().to(torch.bfloat16).contiguous(),
                                         requires_grad=False)  # (N, K) bf16
        bias = getattr(linear, "bias", None)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: Any) -> Any:
        """See the class docstring."""
        lead, k = x.shape[:-1], int(x.shape[-1])
        x2 = x.reshape(-1, k)  # (M, K)
        m, t = int(x2.shape[0]), self.tile_rows
        tiles = max(1, -(-m // t))
        xp = torch.empty((tiles * t, k), dtype=torch.bfloat16, device=x.device)  # (tiles*T, K)
        xp[:m].copy_(x2)
        xp[m:].zero_()
        if tiles == 1:
            out = F.linear(xp, self.weight)  # (T, N) bf16
        else:
            out = torch.cat([F.linear(xp[i:i + t], self.weight) for i in range(0, tiles * t, t)])
        y = out[:m].float()  # (M, N) fp32
        if isinstance(self.bias, torch.Tensor):
            y = y + self.bias  # (N,) fp32
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        """``in_features, out_features, tile_rows`` (printed by ``repr(model)``)."""
        return f"in_features={self.in_features}, out_features={self.out_features}, tile_rows={self.tile_rows}"


#: Largest magnitude of a quantised value: symmetric int8 (-127..127; -128 is never used, so
#: negating a weight or an activation never saturates).
QMAX = 127


def quantize_rows(x: Any) -> tuple[Any, Any]:
    """Symmetric per-row int8 quantisation of ``x (..., K)`` float32 (a row: the last dim).

    Returns ``(q (..., K) int8, scale (..., 1) float32)`` with ``x ~= q * scale``, ``scale =
    max|x_row| / 127`` (a row of zeros gets a tiny scale and q = 0). Every operation is
    row-wise (a max, a division, a rounding), so a row's ``q`` and ``scale`` depend on that
    row alone.
    """
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30).div_(QMAX)  # (..., 1)
    q = torch.round(x / scale).clamp_(-QMAX, QMAX).to(torch.int8)  # (..., K)
    return q, scale


#: The last input an :class:`Int8Linear` quantised on this thread, and its quantisation: q/k/v
#: (and gate/up) are called one after another with the same input tensor object, so it is
#: quantised once for them. Reuse is a pure function of the input (the same ``q`` and scale as
#: recomputing), so it changes no bits; it assumes, as transformers' decoders do, that a
#: layer's input is not modified in place between two projections of it.
_LAST = threading.local()


def _quantized_input(x: Any) -> tuple[Any, Any]:
    """:func:`quantize_rows` of ``x (M, K)``, reused when ``x`` is the tensor quantised last."""
    if getattr(_LAST, "x", None) is x:
        return _LAST.q, _LAST.s
    q, s = quantize_rows(x)
    _LAST.x, _LAST.q, _LAST.s = x, q, s
    return q, s


#: Steps of the second activation pass per first-pass step (``act_passes=2``): the residue in
#: [-0.5, 0.5] maps to -127..127.
RESIDUAL_STEPS = 254


def _residual_input(x: Any, xq: Any, xs: Any) -> Any:
    """``round((x / xs - xq) * 254)`` as int8 (``(..., K)``), reused for the tensor ``x`` quantised
    last (q/k/v, gate/up share it, as :func:`_quantized_input`)."""
    if getattr(_LAST, "rx", None) is x:
        return _LAST.r
    r = torch.round((x / xs - xq) * RESIDUAL_STEPS).clamp_(-QMAX, QMAX).to(torch.int8)
    _LAST.rx, _LAST.r = x, r
    return r


def int8_kernel_exact(k: int = 1536, n: int = 64, m: int = 5) -> bool:
    """True when ``torch._int_mm`` exists on this CPU build and returns the exact int32 product.

    The probe multiplies ``(m, k)`` by ``(k, n)`` int8 matrices of extreme values (+-127, the
    worst case for a saturating int16 path such as AVX512-BW's ``vpmaddubsw``) and random
    ones, and compares with the float64 product (exact: every sum is below 2**53). False when
    the op is missing, raises, or differs.
    """
    if not hasattr(torch, "_int_mm"):
        return False
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-QMAX, QMAX + 1, (m, k), dtype=torch.int8, generator=g)  # (m, k)
    b = torch.randint(-QMAX, QMAX + 1, (n, k), dtype=torch.int8, generator=g)  # (n, k)
    a[0].fill_(QMAX)
    a[1].fill_(-QMAX)
    b[0].fill_(QMAX)
    b[1].fill_(-QMAX)
    try:
        got = torch._int_mm(a, b.t())  # (m, n) int32
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(got.double(), a.double() @ b.double().t()))


class Int8Linear(torch.nn.Module):
    """``y = x @ W.T + b`` as an int8 x int8 -> int32 GEMM (w8a8), fp32 in and out.

    Args:
        linear: the ``nn.Linear`` (weight ``(N, K)``) it replaces. Its weight is quantised
            here, once, per output channel: ``W[n] ~= Wq[n] * w_scale[n]``, symmetric int8,
            ``w_scale[n] = max|W[n]| / 127``. The bias (if any) is kept in fp32.
        act_passes: 1 (w8a8) or 2: each activation row also as its rounding residue
            ``round((x / x_scale - xq) * 254)`` in a second exact int8 GEMM, added as
            ``acc + acc2 / 254`` in fp32 (activations to ~15 bits; ``int8a16``).

    ``forward(x)``: ``x (..., K)`` float32 -> ``(..., N)`` float32. Each row of ``x`` is
    quantised on its own (:func:`quantize_rows`, dynamic), multiplied by ``Wq.T`` with
    ``torch._int_mm`` (oneDNN's s8s8s32 GEMM; VNNI on this CPU class), and the int32 result is
    scaled back in fp32: ``y[m, n] = float(acc[m, n]) * x_scale[m] * w_scale[n]``.

    Why this is batch-invariant by construction: integer sums are exact and associative, so
    the int32 ``acc`` does not depend on the kernel, its blocking or how many rows ``M`` the
    call carries (``|acc| <= K * 127 * 127 < 2**31`` for ``K`` < 133 000); every other step
    is element- or row-wise. So no row padding and no tiles: a row's bits depend on its own
    input only (pinned by tests/generation/test_precision.py for ``M`` = 1..300).
    :func:`int8_kernel_exact` checks the kernel at load (a saturating int16 path would break
    exactness).
    """

    def __init__(self, linear: Any, act_passes: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = int(linear.in_features), int(linear.out_features)
        self.act_passes = int(act_passes)
        w = linear.weight.detach().float()  # (N, K)
        q, scale = quantize_rows(w)  # per output channel = per row of W
        # a frozen parameter (not a buffer), so ``model.num_parameters()`` still counts it
        self.weight = torch.nn.Parameter(q.contiguous(), requires_grad=False)  # (N, K) int8
        self.register_buffer("w_scale", scale.reshape(1, -1).contiguous())  # (1, N) fp32
        bias = getattr(linear, "bias", None)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: Any) -> Any:
        """See the class docstring."""
        lead, k = x.shape[:-1], int(x.shape[-1])
        # (..., K) int8, (..., 1) fp32; quantised once for q/k/v and for gate/up (same x)
        xq, xs = _quantized_input(x if x.dtype == torch.float32 else x.float())
        acc = torch._int_mm(xq.reshape(-1, k), self.weight.t())  # (M, N) int32, exact
        w_scale: torch.Tensor = self.w_scale  # type: ignore[assignment]  # (1, N), a buffer
        y = acc.to(torch.float32)  # (M, N)
        if self.act_passes == 2:
            # the rounding residue of each row, x / x_scale - xq in [-0.5, 0.5], as a second
            # int8 operand at 1/254 of the step: activations to ~15 bits, still exact sums
            r = _residual_input(x if x.dtype == torch.float32 else x.float(), xq, xs)
            acc2 = torch._int_mm(r.reshape(-1, k), self.weight.t())  # (M, N) int32, exact
            y = y.add_(acc2.to(torch.float32).div_(RESIDUAL_STEPS))
        y = y.mul_(xs.reshape(-1, 1)).mul_(w_scale)  # (M, N) fp32
        if isinstance(self.bias, torch.Tensor):
            y = y + self.bias  # (N,) fp32
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        """``in_features, out_features`` (printed by ``repr(model)``)."""
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8=int8"
