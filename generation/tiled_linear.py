"""A linear layer computed as bf16 GEMMs of a fixed row count (generation.precision's ``bf16``).

Kept apart from :mod:`generation.precision` so that reading settings and checking the CPU
never imports torch.
"""

from __future__ import annotations

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
