"""The engine's KV: each answer's own buffer (:class:`SeqKV`) and the prefix cache over token blocks.

An answer's KV lives in its :class:`SeqKV` for its life in the engine (the packed attention,
:mod:`generation.packed_attention`, writes and reads it). The prefix cache
(:class:`BlockPrefixCache`) keeps the KV of token *blocks* that earlier answers computed, shared
by all answers (vLLM's automatic prefix caching, chained block hashes): :class:`KVCache` is
what the engine core asks at admission (a buffer, filled with the longest cached chain of the
prompt's blocks) and after each prefill chunk that completes a block (store it).

Blocks are the engine's prefill chunks. Chunk boundaries are a pure function of the prompt
(:func:`generation.engine.scheduler.next_chunk`): the scaffold ``[0, P)`` in chunks of ``c``
from 0, the rest in chunks of ``c`` from ``P``. So the blocks of a prompt of ``N`` tokens are

* block 0: the whole scaffold ``[0, P)`` (when ``P > 0``), however many chunks it takes;
* block ``j >= 1``: ``[P + (j-1)c, P + jc)``, every *full* chunk after the scaffold. The last,
  shorter chunk of a prompt is never a block (a longer prompt computes those positions in a
  chunk of another length, so its bits are not the same computation).

Key of a block: ``sha256(parent key, kind, token ids)``, the chain starting from a root that
names the model (id and weights hash), device, dtype and the chunk size ``c`` (which fixes how
the scaffold block is chunked). A key so names every token before the block's end and every
chunk boundary those tokens were computed in: two prompts that share a key computed that
block with the same inputs in the same chunks.

Exactness: batch invariance (:mod:`generation.engine.core`) makes a chunk's KV a function of
its tokens, its position and the KV before it only (not of its batch mates or its row). A warm
answer loads the longest cached chain, whose KV is bit-identical to what its own cold prefill
would have computed for those blocks, and resumes prefill at that block boundary; every chunk
left has the same boundaries and the same inputs as in the cold run, so every bit after it
(KV, logits, tokens) is the same. A prompt that ends exactly on a cached boundary needs the
next-token logits there: a block keeps the logits row its chunk produced when that chunk ended
a prompt or a scaffold (the rows the engine computes anyway); a chain that covers a whole prompt
is used only when its last block has them, else the last block is computed again.

Storage: each block's K/V (``(tokens, kv_heads, head_dim)`` per layer) is stored once, under
its key, and referenced by every chain through it; a block is never mutated. Admission copies
the chain into the answer's contiguous buffer: ``layers x 2 x kv_heads x cached_tokens x
head_dim`` values (SmolLM2-135M fp32: 45 KiB per token, about 11 MiB for a 256-token block),
far less than computing it; storing a new block clones it out of its answer's buffer once.
That per-answer copy is what remains between this cache and paged attention (answers reading
shared blocks in place).

Eviction: the cache holds at most ``budget_mib`` MiB of K/V and logits. Blocks are kept in
least-recently-used order with every ancestor more recent than its descendants (a hit or a
store touches its chain from the leaf up to the root), so the least recently used block is
always a leaf: evicting it never strands a cached descendant. Evicted tensors that an answer
is copying from stay alive until that copy ends (references, never mutated).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: The prefix cache's memory budget when none is set, MiB (K/V and logits of its blocks).
DEFAULT_PREFIX_CACHE_MIB = 256


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
class BlockPlan:
    """A prompt's blocks (see the module docstring), in chain order: block ``i`` covers
    ``[starts[i], ends[i])`` and is stored under ``keys[i]`` (whose parent is ``keys[i - 1]``).
    ``scaffold``: block 0 is the scaffold (else every block is one full chunk)."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    keys: tuple[str, ...]
    scaffold: bool

    def __len__(self) -> int:
        return len(self.keys)

    def ending_at(self, pos: int) -> int | None:
        """Index of the block that ends at position ``pos``, or None."""
        for i, end in enumerate(self.ends):
            if end == pos:
                return i
            if end > pos:
                return None
        return None


@dataclass(eq=False)
class CachedBlock:
    """One stored block: positions ``[start, start + tokens)`` of every prompt whose chain
    passes through ``key``; ``kv``: layer -> (K, V), each ``(tokens, kv_heads, head_dim)``,
    never mutated; ``last_logits``: the next-token logits ``(vocab,)`` after it, when the chunk
    that computed it ended a prompt or a scaffold (else None); ``nbytes``: what it holds."""

    key: str
    parent: str | None
    start: int
    tokens: int
    kv: dict[int, tuple[Any, Any]]
    last_logits: Any
    nbytes: int
    children: int = 0
    hits: int = 0


def _tensor_bytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def _kv_bytes(kv: dict[int, tuple[Any, Any]]) -> int:
    return sum(_tensor_bytes(k) + _tensor_bytes(v) for k, v in kv.values())


@dataclass
class PrefixCacheStats:
    """Counters of a :class:`BlockPrefixCache` since it was made (or cleared): ``lookups``
    (admissions that asked), ``hits`` (those that loaded at least one block),
    ``cached_tokens`` (tokens loaded, summed), ``stored`` (blocks stored), ``evicted``
    (blocks evicted); ``blocks`` and ``bytes`` held now, ``budget_bytes`` its limit."""

    lookups: int = 0
    hits: int = 0
    cached_tokens: int = 0
    stored: int = 0
    evicted: int = 0
    blocks: int = 0
    bytes: int = 0
    budget_bytes: int = 0


class BlockPrefixCache:
    """The engine's prefix cache: chained token blocks under a memory budget, LRU over leaves.

    Thread-safe (one lock around the index; the tensors themselves are never mutated, so
    copying out of a block needs no lock).

    Args:
        model_id: names the weights (the local generator passes ``model_id@weights_hash``).
        device, dtype: where and in what the KV was computed.
        chunk: the engine's configured prefill chunk, tokens (the grid that
            :meth:`__contains__`, :meth:`get` and :meth:`put` use; an answer's own chunk, which
            a replay may set, picks its own chain).
        budget_mib: K/V plus logits held at most, MiB (0: nothing is kept).

    Raises:
        ValueError: ``chunk < 1`` or ``budget_mib < 0``.
    """

    def __init__(self, model_id: str, device: str, dtype: str, *, chunk: int,
                 budget_mib: float = DEFAULT_PREFIX_CACHE_MIB) -> None:
        if chunk < 1 or budget_mib < 0:
            raise ValueError("chunk must be >= 1 and budget_mib >= 0")
        self.model_id, self.device, self.dtype = model_id, device, dtype
        self.chunk = chunk
        self.budget_bytes = int(budget_mib * (1 << 20))
        self._blocks: OrderedDict[str, CachedBlock] = OrderedDict()  # LRU first
        self._bytes = 0
        self._stats = PrefixCacheStats()
        self._lock = threading.Lock()

    # --- keys --------------------------------------------------------------------------
    def root(self, chunk: int) -> str:
        """The chain's root key for prefill chunk ``chunk``: names model, device, dtype and chunk."""
        text = f"ragbudget-kv|{self.model_id}|{self.device}|{self.dtype}|chunk={int(chunk)}"
        return hashlib.sha256(text.encode()).hexdigest()

    @staticmethod
    def block_key(parent: str, kind: str, ids: Sequence[int]) -> str:
        """``sha256(parent, kind, ids)`` as hex: ``kind`` is ``"s"`` for a scaffold block,
        ``"c"`` for a chunk block; ``ids`` the block's token ids."""
        h = hashlib.sha256(parent.encode())
        h.update(kind.encode())
        h.update(array("q", [int(i) for i in ids]).tobytes())
        return h.hexdigest()

    def plan(self, prompt: Sequence[int], prefix_len: int, chunk: int) -> BlockPlan:
        """The blocks of ``prompt`` (``N`` ids) with scaffold ``prompt[:prefix_len]`` prefilled in
        chunks of ``chunk``: the scaffold block (when ``0 < prefix_len <= N``), then every full
        chunk after it (module docstring).

        Raises:
            ValueError: ``chunk < 1`` or ``prefix_len`` outside ``[0, N]``.
        """
        n = len(prompt)
        if chunk < 1 or not 0 <= prefix_len <= n:
            raise ValueError(f"bad block plan: chunk={chunk} prefix_len={prefix_len} n={n}")
        starts: list[int] = []
        ends: list[int] = []
        keys: list[str] = []
        parent = self.root(chunk)
        if prefix_len:
            parent = self.block_key(parent, "s", prompt[:prefix_len])
            starts.append(0)
            ends.append(prefix_len)
            keys.append(parent)
        pos = prefix_len
        while pos + chunk <= n:
            parent = self.block_key(parent, "c", prompt[pos:pos + chunk])
            starts.append(pos)
            ends.append(pos + chunk)
            keys.append(parent)
            pos += chunk
        return BlockPlan(tuple(starts), tuple(ends), tuple(keys), bool(prefix_len))

    # --- lookups -----------------------------------------------------------------------
    def _longest(self, plan: BlockPlan, prompt_len: int) -> list[CachedBlock]:
        """The longest cached chain of ``plan`` that may be used (lock held): a chain that
        covers the whole prompt only when its last block has the next-token logits."""
        got: list[CachedBlock] = []
        for key in plan.keys:
            block = self._blocks.get(key)
            if block is None:
                break
            got.append(block)
        if got and plan.ends[len(got) - 1] == prompt_len and got[-1].last_logits is None:
            got.pop()
        return got

    def match(self, plan: BlockPlan, prompt_len: int) -> tuple[list[CachedBlock], int, Any]:
        """``(blocks, cached_tokens, first_logits)`` for an answer being admitted: the longest
        cached chain of ``plan`` (marked most recently used, leaf first), the tokens it covers,
        and the logits ``(vocab,)`` after it when it covers the whole ``prompt_len`` (else None)."""
        with self._lock:
            got = self._longest(plan, prompt_len)
            self._stats.lookups += 1
            for block in reversed(got):  # leaf first: every ancestor stays more recent
                self._blocks.move_to_end(block.key)
                block.hits += 1
            cached = got[-1].start + got[-1].tokens if got else 0
            if got:
                self._stats.hits += 1
                self._stats.cached_tokens += cached
        logits = got[-1].last_logits if got and cached == prompt_len else None
        return got, cached, logits

    def cached_tokens(self, prompt: Sequence[int], prefix_len: int, chunk: int | None = None) -> int:
        """Tokens of ``prompt`` an admission now would load (its longest usable cached chain), 0
        when none; ``chunk`` defaults to the configured one. Changes nothing (no LRU touch):
        what the planner and the engine's batch snapshot read.

        Raises:
            ValueError: as :meth:`plan`.
        """
        plan = self.plan(prompt, prefix_len, chunk or self.chunk)
        with self._lock:
            got = self._longest(plan, len(prompt))
        return got[-1].start + got[-1].tokens if got else 0

    def has(self, key: str) -> bool:
        """True when the block ``key`` is cached now."""
        with self._lock:
            return key in self._blocks

    # --- stores ------------------------------------------------------------------------
    def insert(self, key: str, parent: str | None, start: int, kv: dict[int, tuple[Any, Any]],
               last_logits: Any) -> bool:
        """Store a block (the caller must not touch ``kv`` or ``last_logits`` afterwards):
        ``kv`` layer -> (K, V), each ``(tokens, kv_heads, head_dim)``, at positions from
        ``start``; ``parent`` the key of the block before it (None: the chain's first block).
        A block already held is only marked used (and given ``last_logits`` when it had none).
        Then the least recently used leaves are evicted until the cache is within its budget.

        Returns False when nothing was stored: its parent is not cached (the block would be
        unreachable) or it alone is larger than the budget.
        """
        tokens = int(next(iter(kv.values()))[0].shape[0]) if kv else 0
        logit_bytes = _tensor_bytes(last_logits) if last_logits is not None else 0
        with self._lock:
            if parent is not None and parent not in self._blocks:
                return False
            if key in self._blocks:
                return self._mark(key, last_logits)
            nbytes = _kv_bytes(kv) + logit_bytes
            if nbytes > self.budget_bytes:
                return False
            self._blocks[key] = CachedBlock(key, parent, start, tokens, kv, last_logits, nbytes)
            self._bytes += nbytes
            self._stats.stored += 1
            if parent is not None:
                self._blocks[parent].children += 1
            self._touch_chain(key)
            self._evict_to_budget()
            return key in self._blocks

    def mark(self, key: str, last_logits: Any = None) -> bool:
        """Mark the cached block ``key`` (and its chain) most recently used and give it
        ``last_logits`` ``(vocab,)`` when it has none; False when it is not cached."""
        with self._lock:
            return key in self._blocks and self._mark(key, last_logits)

    def _mark(self, key: str, last_logits: Any) -> bool:
        """:meth:`mark` with the lock held (``key`` is cached)."""
        block = self._blocks[key]
        if block.last_logits is None and last_logits is not None:
            block.last_logits = last_logits
            block.nbytes += _tensor_bytes(last_logits)
            self._bytes += _tensor_bytes(last_logits)
        self._touch_chain(key)
        self._evict_to_budget()
        return key in self._blocks

    def _touch_chain(self, key: str | None) -> None:
        """Mark ``key`` and its ancestors most recently used, leaf first (lock held)."""
        while key is not None:
            self._blocks.move_to_end(key)
            key = self._blocks[key].parent

    def _evict_to_budget(self) -> None:
        """Evict least recently used blocks (always leaves) until within budget (lock held)."""
        while self._bytes > self.budget_bytes and self._blocks:
            key, block = self._blocks.popitem(last=False)
            assert block.children == 0, "the least recently used block must be a leaf"
            self._bytes -= block.nbytes
            self._stats.evicted += 1
            if block.parent is not None:
                self._blocks[block.parent].children -= 1

    # --- the scaffold view (the generator's warm/known checks) -------------------------
    def _scaffold_key(self, prefix_ids: Sequence[int]) -> str:
        return self.block_key(self.root(self.chunk), "s", prefix_ids)

    def __contains__(self, prefix_ids: object) -> bool:
        """True when the scaffold block of exactly ``prefix_ids`` (at the configured chunk) is cached."""
        if not isinstance(prefix_ids, list | tuple) or not prefix_ids:
            return False
        return self.has(self._scaffold_key(prefix_ids))

    def get(self, prefix_ids: Sequence[int]) -> CachedBlock | None:
        """The scaffold block of exactly ``prefix_ids`` (marked most recently used), or None."""
        key = self._scaffold_key(prefix_ids)
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._touch_chain(key)
            return block

    def put(self, prefix_ids: Sequence[int], kv: dict[int, tuple[Any, Any]], last_logits: Any,
            compute_ms: float = 0.0) -> CachedBlock | None:
        """Store ``prefix_ids`` as a scaffold block (``kv``: layer -> (K, V), each
        ``(len(prefix_ids), kv_heads, head_dim)``; ``last_logits`` ``(vocab,)``); the block, or
        None when it does not fit the budget. ``compute_ms`` is accepted for the old call shape."""
        key = self._scaffold_key(prefix_ids)
        if not self.insert(key, None, 0, kv, last_logits):
            return None
        with self._lock:
            return self._blocks.get(key)

    # --- housekeeping ------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    @property
    def bytes_used(self) -> int:
        """Bytes of K/V and logits held now (never above :attr:`budget_bytes` after a store)."""
        with self._lock:
            return self._bytes

    def stats(self) -> PrefixCacheStats:
        """A copy of the counters, with the blocks and bytes held now."""
        with self._lock:
            return PrefixCacheStats(**{**self._stats.__dict__, "blocks": len(self._blocks),
                                       "bytes": self._bytes, "budget_bytes": self.budget_bytes})

    def lru_keys(self) -> list[str]:
        """Keys held, least recently used first (the eviction order)."""
        with self._lock:
            return list(self._blocks)

    def clear(self) -> None:
        """Drop every block (and its tensors) and reset the counters."""
        with self._lock:
            self._blocks.clear()
            self._bytes = 0
            self._stats = PrefixCacheStats()


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

    def admit(self, prompt: list[int], prefix_len: int, max_new: int, chunk: int) -> Admission:
        """A KV buffer for a ``prompt`` that may produce ``max_new`` tokens (room for
        ``len(prompt) + max_new + 1`` positions), prefilled in chunks of ``chunk``: with the
        block cache, its longest cached chain loaded; else its first ``prefix_len`` tokens
        when the scaffold store holds them.

        Raises:
            Exception: whatever the lookup or the copy raises (the core ends that answer alone).
        """
        kv = SeqKV(len(prompt) + max_new + 1)
        if self.blocks is not None:
            plan = self.blocks.plan(prompt, prefix_len, chunk)
            got, cached, logits = self.blocks.match(plan, len(prompt))
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
