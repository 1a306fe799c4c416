"""Packed attention: one engine step's rows, each answer's rows over that answer's own KV.

The engine (:mod:`generation.engine`) packs the rows of several answers into one
forward. Linear layers work row by row; attention must not mix answers. So the model's
attention modules call :func:`packed_attention` (registered with
``transformers.AttentionInterface`` under :data:`ATTN_NAME`), which splits the step's rows
into :class:`Segment` s, writes each segment's new K/V into its answer's
:class:`generation.engine.kv_cache.SeqKV`
at its positions, and attends each segment's queries over that answer's buffer only, with
shapes that depend on the answer alone (its chunk length and position): an answer's bits do
not depend on its batch mates (docs/receipts.md, batch invariance). Any decoder whose
attention modules call the attention interface with ``layer_idx`` works; the packing state
travels as the ``ragbudget_step`` keyword argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from generation.engine.kv_cache import SeqKV

ATTN_NAME = "ragbudget_packed"


@dataclass
class Segment:
    """The rows ``[row, row + n)`` of a step belong to one answer at positions ``[pos, pos + n)``."""

    kv: SeqKV
    row: int
    n: int
    pos: int


@dataclass
class StepContext:
    """What one engine step hands to :func:`packed_attention` (as the ``ragbudget_step`` model
    kwarg): the step's packed rows split into :class:`Segment` s, one per answer. ``abort``:
    asked at every layer; True stops the forward there with :class:`StepAborted` (the engine's
    warm work gives way to an answer that arrived; the step's K/V writes are then partial)."""

    segments: list[Segment]
    abort: Callable[[], bool] | None = None


class StepAborted(Exception):
    """A step's ``abort`` said stop (:class:`StepContext`): its forward ended between layers."""


def packed_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                     dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[Any, None]:
    """Attention function for ``transformers.AttentionInterface``: each segment over its own KV.

    ``query`` is ``(1, heads, rows, head_dim)``, ``key``/``value`` ``(1, kv_heads, rows, head_dim)``
    (RoPE applied); the new K/V are written into each answer's buffer at its positions and
    the segment's queries attend to positions ``<= their own`` (within ``sliding_window`` when
    the layer has one). Padding rows get zeros. Returns ``((1, rows, heads, head_dim), None)``.

    Raises:
        RuntimeError: called without a ``ragbudget_step`` context, or with logit soft-capping
            (not implemented here).
    """
    import torch
    import torch.nn.functional as F

    ctx: StepContext | None = kwargs.get("ragbudget_step")
    if ctx is None:
        raise RuntimeError("packed attention needs the ragbudget_step context")
    if ctx.abort is not None and ctx.abort():
        raise StepAborted("the step gave way")
    if kwargs.get("softcap") is not None:
        raise RuntimeError("attention logit soft-capping is not supported by the packed engine")
    window = kwargs.get("sliding_window")
    layer = int(module.layer_idx)
    rows, heads = int(query.shape[2]), int(query.shape[1])
    out = query.new_zeros((1, rows, heads, int(value.shape[3])))  # (1, rows, heads, head_dim)
    for seg in ctx.segments:
        s, n, p0 = seg.row, seg.n, seg.pos
        kb, vb = seg.kv.buffers(layer, key)
        kb[p0:p0 + n] = key[0, :, s:s + n].transpose(0, 1)  # (n, kv_heads, head_dim)
        vb[p0:p0 + n] = value[0, :, s:s + n].transpose(0, 1)  # (n, kv_heads, head_dim)
        length = p0 + n
        k = kb[:length].transpose(0, 1).unsqueeze(0)  # (1, kv_heads, length, head_dim)
        v = vb[:length].transpose(0, 1).unsqueeze(0)  # (1, kv_heads, length, head_dim)
        q = query[:, :, s:s + n].contiguous()  # (1, heads, n, head_dim)
        mask = None
        if n > 1 or window:
            qpos = torch.arange(p0, p0 + n, device=query.device).unsqueeze(1)  # (n, 1)
            kpos = torch.arange(0, length, device=query.device).unsqueeze(0)  # (1, length)
            mask = kpos <= qpos  # (n, length), True = attend
            if window:
                mask = mask & (kpos > qpos - int(window))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                           enable_gqa=heads != int(k.shape[1]))  # (1, heads, n, head_dim)
        out[0, s:s + n] = o[0].transpose(0, 1)  # (n, heads, head_dim)
    return out, None


def register_packed_attention() -> None:
    """Register :func:`packed_attention` with transformers under :data:`ATTN_NAME` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, packed_attention)
