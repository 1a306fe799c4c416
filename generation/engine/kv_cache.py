"""The engine's KV: each answer's own buffer (:class:`SeqKV`) and the engine core's view of KV
(:class:`KVCache`: a buffer per answer, filled at admission from the prefix cache over token
blocks, :mod:`generation.engine.block_cache`, which this module re-exports).

An answer's KV lives in its :class:`SeqKV` for its life in the engine (the packed attention,
:mod:`generation.packed_attention`, writes and reads it). :class:`KVCache` is what the engine
core asks at admission (a buffer, filled with the longest cached chain of the prompt's blocks)
and after each prefill chunk that completes a block (store it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from generation.engine.block_cache import (
    DEFAULT_PREFIX_CACHE_MIB,
    BlockPlan,
    BlockPrefixCache,
    CachedBlock,
    Pin,
    PrefixCacheStats,
)

__all__ = ["DEFAULT_PREFIX_CACHE_MIB", "Admission", "BlockPlan", "BlockPrefixCache", "CachedBlock",
           "KVCache", "Pin", "PrefixCacheStats", "SeqKV"]



class SeqKV:
    """One answer's KV: per layer a ``(capacity, kv_heads, head_dim)`` buffer for K and V.

    Laid out token-major so a prefix view ``buf[:L]`` has strides independent of the capacity.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.k: dict[int, Any] = {}
        self.v: dict[int, Any] = {}

    def buffers(self, layer: int, like: Any) -> tuple[Any, Any]:
        """The layer's (K, V) buffers, allocated on first use like ``like`` (``(1, H, T, D)``)."""
        kb = self.k.get(layer)
        if kb is None:
            import torch

            shape = (self.capacity, int(like.shape[1]), int(like.shape[3]))  # (T_max, kv_heads, head_dim)
            kb = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.k[layer] = kb
            self.v[layer] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return kb, self.v[layer]

    def allocate(self, layers: int, kv_heads: int, head_dim: int, dtype: Any, device: Any) -> None:
        """Allocate every layer's (zeroed) buffers now, ``(capacity, kv_heads, head_dim)`` each, so
        a timed step does not pay for them (step calibration runs on such stand-in caches)."""
        import torch

        for layer in range(layers):
            self.k[layer] = torch.zeros((self.capacity, kv_heads, head_dim), dtype=dtype, device=device)
            self.v[layer] = torch.zeros_like(self.k[layer])

    def load_prefix(self, prefix: dict[int, tuple[Any, Any]]) -> None:
        """Copy a stored prefix (layer -> (K, V) of shape ``(P, H, D)``) into the buffers."""
        import torch

        for layer, (k, v) in prefix.items():
            # (T_max, kv_heads, head_dim)
            kb = torch.zeros((self.capacity, *k.shape[1:]), dtype=k.dtype, device=k.device)
            vb = torch.zeros_like(kb)
            kb[: k.shape[0]].copy_(k)  # (P, kv_heads, head_dim)
            vb[: v.shape[0]].copy_(v)
            self.k[layer], self.v[layer] = kb, vb

    def export_prefix(self, length: int) -> dict[int, tuple[Any, Any]]:
        """Private copies of the first ``length`` tokens of every layer (for the prefix cache)."""
        return {layer: (self.k[layer][:length].clone(), self.v[layer][:length].clone())
                for layer in self.k}

    def load_blocks(self, blocks: Sequence[CachedBlock]) -> None:
        """Copy cached blocks, in chain order from position 0, into freshly allocated buffers:
        block ``b`` fills ``[b.start, b.start + b.tokens)`` of every layer. Costs one copy of
        every cached value (see the module docstring)."""
        import torch

        if not blocks:
            return
        for layer, (k0, _) in blocks[0].kv.items():
            # (T_max, kv_heads, head_dim)
            kb = torch.zeros((self.capacity, *k0.shape[1:]), dtype=k0.dtype, device=k0.device)
            vb = torch.zeros_like(kb)
            for b in blocks:
                k, v = b.kv[layer]  # (b.tokens, kv_heads, head_dim)
                kb[b.start:b.start + b.tokens].copy_(k)
                vb[b.start:b.start + b.tokens].copy_(v)
            self.k[layer], self.v[layer] = kb, vb

    def export_range(self, start: int, end: int) -> dict[int, tuple[Any, Any]]:
        """Private copies of positions ``[start, end)`` of every layer: layer -> (K, V), each
        ``(end - start, kv_heads, head_dim)`` (a block for the prefix cache)."""
        return {layer: (self.k[layer][start:end].clone(), self.v[layer][start:end].clone())
                for layer in self.k}


@dataclass(frozen=True)
class Admission:
    """What :meth:`KVCache.admit` gives a new answer: its ``kv`` buffer, ``cached_tokens``
    taken from the prefix cache (0 on a miss) and, when the whole prompt was cached, the
    ``first_logits`` ``(vocab,)`` its first token is chosen from (else None); with the block
    cache, its ``plan`` (its blocks) and ``cached_blocks`` (how many of them were loaded)."""

    kv: SeqKV
    cached_tokens: int
    first_logits: Any = None
    plan: BlockPlan | None = None
    cached_blocks: int = 0


class KVCache:
    """The engine core's view of KV: a buffer per answer, the prefix cache behind it.

    With ``blocks`` (the engine's shared :class:`BlockPrefixCache`) an answer loads the longest
    cached chain of its blocks and stores each block it computes. Without it, a private
    scaffold store is used through three callbacks (the calibration timers run answers on a
    private engine this way, so their synthetic prompts stay out of the shared cache):

    Args:
        lookup: ``prefix_ids -> (kv dict, last_logits) | None`` (the scaffold's entry).
        store: ``(prefix_ids, kv dict, last_logits) -> None``.
        known: ``prefix_ids -> bool``, whether the store holds them now; None: not known.
        blocks: the block prefix cache (then the callbacks are not used).
    """

    def __init__(self, lookup: Callable[[list[int]], tuple[Any, Any] | None] | None = None,
                 store: Callable[[list[int], Any, Any], None] | None = None,
                 known: Callable[[list[int]], bool] | None = None,
                 blocks: BlockPrefixCache | None = None) -> None:
        self.lookup, self.store, self.known = lookup, store, known
        self.blocks = blocks

    def admit(self, prompt: list[int], prefix_len: int, max_new: int, chunk: int, *,
              count: bool = True) -> Admission:
        """A KV buffer for a ``prompt`` that may produce ``max_new`` tokens (room for
        ``len(prompt) + max_new + 1`` positions), prefilled in chunks of ``chunk``: with the
        block cache, its longest cached chain loaded; else its first ``prefix_len`` tokens
        when the scaffold store holds them. ``count`` False: not counted as a lookup (warm work).

        Raises:
            Exception: whatever the lookup or the copy raises (the core ends that answer alone).
        """
        kv = SeqKV(len(prompt) + max_new + 1)
        if self.blocks is not None:
            plan = self.blocks.plan(prompt, prefix_len, chunk)
            got, cached, logits = self.blocks.match(plan, len(prompt), count=count)
            kv.load_blocks(got)
            return Admission(kv, cached, logits, plan, len(got))
        cached, first_logits = 0, None
        if prefix_len and self.lookup is not None:
            hit = self.lookup(prompt[:prefix_len])
            if hit is not None:
                prefix_kv, logits = hit
                kv.load_prefix(prefix_kv)
                cached = prefix_len
                if cached == len(prompt):
                    first_logits = logits
        return Admission(kv, cached, first_logits)

    def store_block(self, kv: SeqKV, plan: BlockPlan, index: int, last_logits: Any) -> None:
        """Store block ``index`` of ``plan`` out of the answer's ``kv`` (which holds it, and
        every block before it, computed or loaded), with the logits row ``(vocab,)`` its chunk
        produced (None when it produced none). A block before it that was evicted meanwhile is
        stored again first (from the same buffer), so the chain stays reachable. Copies only
        the blocks the cache does not hold."""
        assert self.blocks is not None
        if not self.blocks.keeps(plan, index):
            return  # the cache's scope leaves this block out
        for i in range(index + 1):
            key = plan.keys[i]
            logits = last_logits.clone() if i == index and last_logits is not None else None
            if self.blocks.has(key):
                if i == index:
                    self.blocks.mark(key, logits)
                continue
            if not self.blocks.insert(key, plan.keys[i - 1] if i else None, plan.starts[i],
                                      kv.export_range(plan.starts[i], plan.ends[i]), logits):
                return  # it does not fit (or its parent went): the rest of the chain cannot be stored

    def pin(self, prompt: list[int], prefix_len: int, chunk: int) -> Pin | None:
        """Pin ``prompt``'s cached chain until its request is admitted or abandoned
        (:meth:`BlockPrefixCache.pin`); None without the block cache."""
        return self.blocks.pin(prompt, prefix_len, chunk) if self.blocks is not None else None

    def take_pin(self, prompt: list[int], prefix_len: int, chunk: int) -> Pin | None:
        """The waiting pin of ``prompt`` (:meth:`BlockPrefixCache.take_pin`), now the caller's; None
        when there is none or no block cache."""
        return self.blocks.take_pin(prompt, prefix_len, chunk) if self.blocks is not None else None

    def cached_tokens(self, prompt: list[int], prefix_len: int, chunk: int) -> int:
        """Tokens of ``prompt`` an admission now would take from the cache (0 when unknown)."""
        if self.blocks is not None:
            return self.blocks.cached_tokens(prompt, prefix_len, chunk)
        if 0 < prefix_len < len(prompt) and self.holds(prompt[:prefix_len]):
            return prefix_len
        return 0

    def store_prefix(self, prompt: list[int], prefix_len: int, kv: SeqKV, last_logits: Any) -> None:
        """Store the scaffold ``prompt[:prefix_len]`` in the private store: a copy of the first
        ``prefix_len`` positions of ``kv`` and the logits row ``(vocab,)`` after it."""
        if self.store is not None:
            self.store(prompt[:prefix_len], kv.export_prefix(prefix_len), last_logits.clone())

    def holds(self, prefix_ids: list[int]) -> bool:
        """True when the private scaffold store is known to hold exactly ``prefix_ids`` now."""
        return self.known is not None and bool(self.known(prefix_ids))
