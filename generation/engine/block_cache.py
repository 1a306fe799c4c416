"""The engine's prefix cache over token blocks, and the pins that hold a planned chain until admission.

The prefix cache (:class:`BlockPrefixCache`) keeps the KV of token *blocks* that earlier
answers computed, shared by all answers (vLLM's automatic prefix caching, chained block
hashes); :class:`generation.engine.kv_cache.KVCache` loads an answer's longest cached chain at
admission and stores each block the answer computes.

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
least-recently-used order with every ancestor more recent than its descendants (a hit, a pin or
a store touches its chain from the leaf up to the root). Eviction takes the least recently used
block that is not pinned. That block is always a leaf: a pin holds a whole chain from its root,
so the children of an unpinned block are unpinned, and less recent than it. So evicting never
strands a cached descendant. Evicted tensors that an answer is copying from stay alive until
that copy ends (references, never mutated).

Pins (:meth:`BlockPrefixCache.pin`): the planner prices a prompt's cached tokens before it
chooses ``k``; the chain it priced is pinned (a count per block) until the answer is admitted
(the engine takes the pin at submit, :meth:`BlockPrefixCache.take_pin`, and releases it once its
admission loaded the chain) or abandoned (cancelled, refused, failed: :meth:`Pin.release`,
idempotent). A pinned block is never evicted, so admission finds at least what the pin counted.
Pinned blocks are held inside the budget, never beside it: pins together may hold at most
``pin_share`` of it (default half, so the running answers' new blocks keep room to be stored),
and a pin that would go past that pins (and reports) a shorter chain instead. A store that
finds no unpinned block left to evict is not kept; the budget is never overrun.

Scope (:attr:`BlockPrefixCache.scope`): ``"all"`` (default) keeps every block; ``"scaffold"``
keeps and loads the scaffold block alone, the cache as it was before blocks past the scaffold
were kept (a baseline for ``benchmarks/kv_reuse.py``).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The prefix cache's memory budget when none is set, MiB (K/V and logits of its blocks).
DEFAULT_PREFIX_CACHE_MIB = 256

#: What the cache may keep (:attr:`BlockPrefixCache.scope`).
SCOPES = ("all", "scaffold")


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
    pins: int = 0  # pins holding it (never evicted while > 0)


def _tensor_bytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def _kv_bytes(kv: dict[int, tuple[Any, Any]]) -> int:
    return sum(_tensor_bytes(k) + _tensor_bytes(v) for k, v in kv.values())


@dataclass
class PrefixCacheStats:
    """Counters of a :class:`BlockPrefixCache` since it was made (or cleared): ``lookups``
    (admissions that asked), ``hits`` (those that loaded at least one block),
    ``cached_tokens`` (tokens loaded, summed), ``stored`` (blocks stored), ``evicted``
    (blocks evicted), ``refused`` (blocks not kept: too large, or no unpinned block left to
    evict), ``pin_shortened`` (pins that pinned a shorter chain than cached, for the pin limit),
    ``peak_bytes`` (most bytes ever held); ``blocks`` and ``bytes`` held now, ``budget_bytes``
    its limit; ``pins`` (pins held now), ``pinned_blocks`` and ``pinned_bytes`` (what they hold);
    ``warm_tokens``: tokens the engine's idle-time warm work computed into this cache
    (``generation.engine.core``, "Warm work"; counted by :meth:`BlockPrefixCache.count_warm`)."""

    lookups: int = 0
    hits: int = 0
    cached_tokens: int = 0
    stored: int = 0
    evicted: int = 0
    refused: int = 0
    pin_shortened: int = 0
    peak_bytes: int = 0
    blocks: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    pins: int = 0
    pinned_blocks: int = 0
    pinned_bytes: int = 0
    warm_tokens: int = 0


class Pin:
    """A chain of cached blocks held against eviction (:meth:`BlockPrefixCache.pin`).

    ``cached_tokens``: the tokens of the pinned prompt an admission will load (the end of the
    pinned chain; 0 when nothing is pinned); ``keys``: the pinned blocks, root first.
    :meth:`release` is idempotent and thread-safe: whoever ends the request first (the engine
    at admission, or the caller on cancel or error) releases it.
    """

    def __init__(self, cache: BlockPrefixCache, ident: str, keys: tuple[str, ...],
                 cached_tokens: int, epoch: int) -> None:
        self.cache, self.ident, self.keys = cache, ident, keys
        self.cached_tokens, self.epoch = cached_tokens, epoch
        self.held = True

    def release(self) -> None:
        """Unpin the chain (once; later calls do nothing)."""
        self.cache._release(self)


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
        pin_share: the share of the budget pins may hold together (module docstring, "Pins").
        scope: ``"all"`` or ``"scaffold"`` (module docstring, "Scope"); may be changed later
            (:attr:`scope`): a block past the scaffold is then neither loaded nor stored.

    Raises:
        ValueError: ``chunk < 1``, ``budget_mib < 0``, ``pin_share`` outside ``[0, 1]`` or an
            unknown ``scope``.
    """

    def __init__(self, model_id: str, device: str, dtype: str, *, chunk: int,
                 budget_mib: float = DEFAULT_PREFIX_CACHE_MIB, pin_share: float = 0.5,
                 scope: str = "all") -> None:
        if chunk < 1 or budget_mib < 0:
            raise ValueError("chunk must be >= 1 and budget_mib >= 0")
        if not 0.0 <= pin_share <= 1.0 or scope not in SCOPES:
            raise ValueError(f"pin_share must be in [0, 1] and scope one of {SCOPES}")
        self.model_id, self.device, self.dtype = model_id, device, dtype
        self.chunk = chunk
        self.budget_bytes = int(budget_mib * (1 << 20))
        self.pin_limit_bytes = int(self.budget_bytes * pin_share)
        self.scope = scope
        self._blocks: OrderedDict[str, CachedBlock] = OrderedDict()  # LRU first
        self._bytes = 0
        self._pinned_bytes = 0
        self._pins_held = 0
        self._waiting: dict[str, list[Pin]] = {}  # prompt identity -> pins no request took yet
        self._epoch = 0  # grows at clear(): a pin of an older epoch holds nothing
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
        keys = plan.keys if self.scope == "all" else plan.keys[:1] if plan.scaffold else ()
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            got.append(block)
        if got and plan.ends[len(got) - 1] == prompt_len and got[-1].last_logits is None:
            got.pop()
        return got

    def match(self, plan: BlockPlan, prompt_len: int, *,
              count: bool = True) -> tuple[list[CachedBlock], int, Any]:
        """``(blocks, cached_tokens, first_logits)`` for an answer being admitted: the longest
        cached chain of ``plan`` (marked most recently used, leaf first), the tokens it covers,
        and the logits ``(vocab,)`` after it when it covers the whole ``prompt_len`` (else None).
        ``count`` False leaves the lookup counters (and each block's hits) as they are: the
        engine's warm work is not an answer."""
        with self._lock:
            got = self._longest(plan, prompt_len)
            self._stats.lookups += int(count)
            for block in reversed(got):  # leaf first: every ancestor stays more recent
                self._blocks.move_to_end(block.key)
                block.hits += int(count)
            cached = got[-1].start + got[-1].tokens if got else 0
            if got and count:
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

    # --- pins --------------------------------------------------------------------------
    def identity(self, prompt: Sequence[int], prefix_len: int, chunk: int) -> str:
        """What names a prompt's pin: ``sha256`` over the chain root (model, device, dtype,
        ``chunk``), ``prefix_len`` and every token id, as hex."""
        h = hashlib.sha256(self.root(chunk).encode())
        h.update(f"|{int(prefix_len)}|".encode())
        h.update(array("q", [int(i) for i in prompt]).tobytes())
        return h.hexdigest()

    def pin(self, prompt: Sequence[int], prefix_len: int, chunk: int | None = None) -> Pin:
        """Pin the longest usable cached chain of ``prompt`` (as :meth:`cached_tokens` reads it)
        until the pin is released, and count it as looked up (most recently used). Pins hold at
        most :attr:`pin_limit_bytes` together: a chain that would go past it is pinned only as far
        as it fits (root first), and the pin's ``cached_tokens`` say so. The pin waits under
        the prompt's :meth:`identity` for the request that runs it (:meth:`take_pin`).

        Raises:
            ValueError: as :meth:`plan`.
        """
        chunk = chunk or self.chunk
        plan = self.plan(prompt, prefix_len, chunk)
        ident = self.identity(prompt, prefix_len, chunk)
        with self._lock:
            got = self._longest(plan, len(prompt))
            room = self.pin_limit_bytes - self._pinned_bytes
            fits = 0
            for block in got:
                need = block.nbytes if block.pins == 0 else 0
                if need > room:
                    break
                room -= need
                fits += 1
            if fits < len(got):
                self._stats.pin_shortened += 1
                got = got[:fits]
            for block in got:
                if block.pins == 0:
                    self._pinned_bytes += block.nbytes
                block.pins += 1
            if got:
                self._touch_chain(got[-1].key)
            cached = got[-1].start + got[-1].tokens if got else 0
            pin = Pin(self, ident, tuple(b.key for b in got), cached, self._epoch)
            self._pins_held += 1
            self._waiting.setdefault(ident, []).append(pin)
        return pin

    def take_pin(self, prompt: Sequence[int], prefix_len: int, chunk: int) -> Pin | None:
        """The oldest pin of this prompt no request has taken yet (it is now the caller's to
        release), or None. The engine takes it when the request is submitted."""
        ident = self.identity(prompt, prefix_len, chunk)
        with self._lock:
            waiting = self._waiting.get(ident)
            if not waiting:
                return None
            pin = waiting.pop(0)
            if not waiting:
                del self._waiting[ident]
            return pin

    def _release(self, pin: Pin) -> None:
        """:meth:`Pin.release`: unpin its blocks once (a pin from before :meth:`clear` holds none)."""
        with self._lock:
            if not pin.held:
                return
            pin.held = False
            self._pins_held -= 1
            waiting = self._waiting.get(pin.ident)
            if waiting is not None and pin in waiting:
                waiting.remove(pin)
                if not waiting:
                    del self._waiting[pin.ident]
            if pin.epoch != self._epoch:
                return
            for key in pin.keys:
                block = self._blocks[key]  # pinned: never evicted
                block.pins -= 1
                if block.pins == 0:
                    self._pinned_bytes -= block.nbytes

    def pins_held(self) -> int:
        """Pins not released yet (0 when every planned request was admitted or abandoned)."""
        with self._lock:
            return self._pins_held

    # --- stores ------------------------------------------------------------------------
    def keeps(self, plan: BlockPlan, index: int) -> bool:
        """True when block ``index`` of ``plan`` may be stored under the :attr:`scope`."""
        return self.scope == "all" or (index == 0 and plan.scaffold)

    def insert(self, key: str, parent: str | None, start: int, kv: dict[int, tuple[Any, Any]],
               last_logits: Any) -> bool:
        """Store a block (the caller must not touch ``kv`` or ``last_logits`` afterwards):
        ``kv`` layer -> (K, V), each ``(tokens, kv_heads, head_dim)``, at positions from
        ``start``; ``parent`` the key of the block before it (None: the chain's first block).
        A block already held is only marked used (and given ``last_logits`` when it had none).
        Then the least recently used leaves are evicted until the cache is within its budget.

        Room is made first, by evicting least recently used unpinned blocks other than its
        chain, so the bytes held never go above the budget, not even for a moment.

        Returns False when nothing was stored: its parent is not cached (the block would be
        unreachable), or it does not fit beside the pinned blocks and its own chain.
        """
        tokens = int(next(iter(kv.values()))[0].shape[0]) if kv else 0
        logit_bytes = _tensor_bytes(last_logits) if last_logits is not None else 0
        with self._lock:
            if parent is not None and parent not in self._blocks:
                return False
            if key in self._blocks:
                return self._mark(key, last_logits)
            nbytes = _kv_bytes(kv) + logit_bytes
            if not self._make_room(nbytes, parent):
                self._stats.refused += 1
                return False
            self._blocks[key] = CachedBlock(key, parent, start, tokens, kv, last_logits, nbytes)
            self._bytes += nbytes
            self._stats.peak_bytes = max(self._stats.peak_bytes, self._bytes)
            self._stats.stored += 1
            if parent is not None:
                self._blocks[parent].children += 1
            self._touch_chain(key)
            return True

    def mark(self, key: str, last_logits: Any = None) -> bool:
        """Mark the cached block ``key`` (and its chain) most recently used and give it
        ``last_logits`` ``(vocab,)`` when it has none; False when it is not cached."""
        with self._lock:
            return key in self._blocks and self._mark(key, last_logits)

    def _mark(self, key: str, last_logits: Any) -> bool:
        """:meth:`mark` with the lock held (``key`` is cached)."""
        block = self._blocks[key]
        self._touch_chain(key)
        if block.last_logits is None and last_logits is not None:
            extra = _tensor_bytes(last_logits)
            pinned = block.pins > 0
            fits_pins = not pinned or self._pinned_bytes + extra <= self.budget_bytes
            if fits_pins and self._make_room(extra, key):
                block.last_logits = last_logits
                block.nbytes += extra
                self._bytes += extra
                self._pinned_bytes += extra if pinned else 0
                self._stats.peak_bytes = max(self._stats.peak_bytes, self._bytes)
        return True

    def _touch_chain(self, key: str | None) -> None:
        """Mark ``key`` and its ancestors most recently used, leaf first (lock held)."""
        while key is not None:
            self._blocks.move_to_end(key)
            key = self._blocks[key].parent

    def _make_room(self, nbytes: int, keep: str | None) -> bool:
        """Evict least recently used unpinned blocks (always leaves: module docstring), never
        ``keep`` or its ancestors, until ``nbytes`` more fit in the budget (lock held). False,
        with nothing evicted, when they cannot fit."""
        spare = self.budget_bytes - self._bytes
        if spare >= nbytes:
            return True
        kept: set[str] = set()
        while keep is not None:
            kept.add(keep)
            keep = self._blocks[keep].parent
        victims: list[str] = []
        for key, block in self._blocks.items():  # least recently used first
            if spare >= nbytes:
                break
            if block.pins == 0 and key not in kept:
                victims.append(key)
                spare += block.nbytes
        if spare < nbytes:
            return False
        for key in victims:
            block = self._blocks.pop(key)
            assert block.children == 0, "an evicted block must be a leaf"
            self._bytes -= block.nbytes
            self._stats.evicted += 1
            if block.parent is not None:
                self._blocks[block.parent].children -= 1
        return True

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
                                       "bytes": self._bytes, "budget_bytes": self.budget_bytes,
                                       "pins": self._pins_held, "pinned_bytes": self._pinned_bytes,
                                       "pinned_blocks": sum(1 for b in self._blocks.values() if b.pins)})

    def count_warm(self, tokens: int) -> None:
        """Count ``tokens`` computed by the engine's warm work (:attr:`PrefixCacheStats.warm_tokens`)."""
        with self._lock:
            self._stats.warm_tokens += int(tokens)

    def lru_keys(self) -> list[str]:
        """Keys held, least recently used first (the eviction order)."""
        with self._lock:
            return list(self._blocks)

    def clear(self) -> None:
        """Drop every block (and its tensors) and reset the counters. Pins held stay held (each
        still needs its release) but hold no block."""
        with self._lock:
            self._blocks.clear()
            self._bytes = 0
            self._pinned_bytes = 0
            self._epoch += 1
            self._stats = PrefixCacheStats()
