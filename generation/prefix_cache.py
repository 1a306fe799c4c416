"""The scaffold prefix KV cache: computed once, kept in a small LRU, reused by copying.

Key: ``(sha256 of the prefix token ids, model id, device, dtype)``. A stored
cache is never handed out: every request gets a deep copy, which the model then
extends in place, so one answer can never change what the next one reads. The
copy costs a memory copy of ``layers x 2 x kv_heads x prefix_tokens x head_dim``
values (SmolLM2-135M fp32: ~46 KiB per token), far less than recomputing.

The cache object is whatever the model's forward pass returns (a transformers
``DynamicCache``); this module only stores, counts and copies it.
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
