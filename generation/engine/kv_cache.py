"""The engine's KV: each answer's own buffer (:class:`SeqKV`) and the scaffold prefix cache.

An answer's KV lives in its :class:`SeqKV` for its life in the engine (the packed attention,
:mod:`generation.packed_attention`, writes and reads it). The scaffold prefix cache
(:class:`PrefixKVCache`) keeps the KV of recent scaffolds: computed once, kept in a small LRU,
reused by copying into a new answer's buffer. :class:`KVCache` is what the engine core asks
at admission (a buffer, filled from the prefix cache on a hit) and after the step that ends a
scaffold (store it).

Key of a prefix: ``(sha256 of the prefix token ids, model id, device, dtype)``. A stored
cache is never handed out: every request gets a copy, which the model then
extends in place, so one answer can never change what the next one reads. The
copy costs a memory copy of ``layers x 2 x kv_heads x prefix_tokens x head_dim``
values (SmolLM2-135M fp32: ~46 KiB per token), far less than recomputing.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from foundation.hashing import sha256_ints


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


@dataclass
class PrefixEntry:
    """One computed prefix: its ids, the KV cache (never mutated), and what it cost.

    ``last_logits`` are the next-token logits after the prefix (``(vocab,)``),
    kept so a prompt that equals the prefix can still produce a first token.
    """

    key: tuple[str, str, str, str]
    ids: tuple[int, ...]  # (prefix_tokens,)
    # transformers DynamicCache: per layer, keys and values (1, kv_heads, prefix_tokens, head_dim)
    kv: Any
    last_logits: Any  # (vocab,) next-token logits
    compute_ms: float
    hits: int = 0


class PrefixKVCache:
    """A small LRU of :class:`PrefixEntry`, keyed by prefix hash and the model's identity.

    Thread-safe for lookups and inserts; computing an entry is the caller's job
    (the local generator computes under its own model lock).
    """

    def __init__(self, model_id: str, device: str, dtype: str, capacity: int = 4) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.model_id, self.device, self.dtype = model_id, device, dtype
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str, str, str], PrefixEntry] = OrderedDict()
        self._lock = threading.Lock()

    def key(self, prefix_ids: list[int] | tuple[int, ...]) -> tuple[str, str, str, str]:
        """``(sha256_ints(prefix_ids), model_id, device, dtype)``."""
        return (sha256_ints(list(prefix_ids)), self.model_id, self.device, self.dtype)

    def get(self, prefix_ids: list[int]) -> PrefixEntry | None:
        """The entry for exactly ``prefix_ids`` (marked most recently used), or None."""
        k = self.key(prefix_ids)
        with self._lock:
            entry = self._entries.get(k)
            if entry is not None:
                self._entries.move_to_end(k)
            return entry

    def __contains__(self, prefix_ids: object) -> bool:
        if not isinstance(prefix_ids, list | tuple):
            return False
        with self._lock:
            return self.key(list(prefix_ids)) in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, prefix_ids: list[int], kv: Any, last_logits: Any, compute_ms: float) -> PrefixEntry:
        """Store a freshly computed cache (the caller must not touch ``kv`` afterwards).

        ``kv``: per layer ``(1, kv_heads, len(prefix_ids), head_dim)`` keys and values;
        ``last_logits``: ``(vocab,)``.
        """
        k = self.key(prefix_ids)
        entry = PrefixEntry(k, tuple(prefix_ids), kv, last_logits, compute_ms)
        with self._lock:
            self._entries[k] = entry
            self._entries.move_to_end(k)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return entry

    def get_or_compute(self, prefix_ids: list[int],
                       compute: Callable[[list[int]], tuple[Any, Any]]) -> tuple[PrefixEntry, bool]:
        """Return ``(entry, hit)``.

        On a miss ``compute(prefix_ids) -> (kv, last_logits)`` runs, is timed and stored.
        """
        entry = self.get(prefix_ids)
        if entry is not None:
            entry.hits += 1
            return entry, True
        t0 = time.perf_counter()
        kv, last_logits = compute(prefix_ids)  # per layer (1, kv_heads, prefix, head_dim) K and V; (vocab,)
        return self.put(prefix_ids, kv, last_logits, (time.perf_counter() - t0) * 1000.0), False

    @staticmethod
    def copy_kv(entry: PrefixEntry) -> Any:
        """A private deep copy of ``entry.kv`` that a request may extend in place."""
        return copy.deepcopy(entry.kv)  # per layer (1, kv_heads, prefix_tokens, head_dim) K and V

    def clear(self) -> None:
        """Drop every entry (and its KV tensors)."""
        with self._lock:
            self._entries.clear()


@dataclass(frozen=True)
class Admission:
    """What :meth:`KVCache.admit` gives a new answer: its ``kv`` buffer, ``cached_tokens``
    taken from the prefix cache (0 on a miss) and, when the whole prompt was cached, the
    ``first_logits`` ``(vocab,)`` its first token is chosen from (else None)."""

    kv: SeqKV
    cached_tokens: int
    first_logits: Any = None


class KVCache:
    """The engine core's view of KV: a buffer per answer, the prefix cache behind it.

    Args:
        lookup: ``prefix_ids -> (kv dict, last_logits) | None`` (the prefix cache's entry).
        store: ``(prefix_ids, kv dict, last_logits) -> None``.
        known: ``prefix_ids -> bool``, whether the prefix cache holds them now; None: not known.
    """

    def __init__(self, lookup: Callable[[list[int]], tuple[Any, Any] | None],
                 store: Callable[[list[int], Any, Any], None],
                 known: Callable[[list[int]], bool] | None = None) -> None:
        self.lookup, self.store, self.known = lookup, store, known

    def admit(self, prompt: list[int], prefix_len: int, max_new: int) -> Admission:
        """A KV buffer for a ``prompt`` that may produce ``max_new`` tokens (room for
        ``len(prompt) + max_new + 1`` positions), its first ``prefix_len`` tokens loaded from
        the prefix cache when it holds them.

        Raises:
            Exception: whatever the lookup or the copy raises (the core ends that answer alone).
        """
        kv = SeqKV(len(prompt) + max_new + 1)
        cached, first_logits = 0, None
        if prefix_len:
            hit = self.lookup(prompt[:prefix_len])
            if hit is not None:
                prefix_kv, logits = hit
                kv.load_prefix(prefix_kv)
                cached = prefix_len
                if cached == len(prompt):
                    first_logits = logits
        return Admission(kv, cached, first_logits)

    def store_prefix(self, prompt: list[int], prefix_len: int, kv: SeqKV, last_logits: Any) -> None:
        """Store the scaffold ``prompt[:prefix_len]``: a private copy of the first
        ``prefix_len`` positions of ``kv`` and the logits row ``(vocab,)`` after it."""
        self.store(prompt[:prefix_len], kv.export_prefix(prefix_len), last_logits.clone())

    def holds(self, prefix_ids: list[int]) -> bool:
        """True when the prefix cache is known to hold exactly ``prefix_ids`` now."""
        return self.known is not None and bool(self.known(prefix_ids))
