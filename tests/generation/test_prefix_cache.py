"""The prefix KV cache over token blocks (small fake tensors, no model) and the incremental
detokenizer.

The block index: chained keys on the engine's prefill-chunk grid, the longest cached chain,
least-recently-used eviction of leaves under a byte budget, and what the engine's store does
with a chain whose ancestors were evicted.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from generation.base import GenParams, IncrementalDetokenizer
from generation.engine.kv_cache import BlockPrefixCache, KVCache, SeqKV

LAYERS, HEADS, DIM = 2, 1, 4
#: bytes of one token's K/V in these fake blocks: layers x (K, V) x heads x dim x fp32
TOKEN_BYTES = LAYERS * 2 * HEADS * DIM * 4


def fake_kv(start: int, tokens: int) -> dict[int, tuple[Any, Any]]:
    """Layer -> (K, V) ``(tokens, HEADS, DIM)`` whose values name their position."""
    pos = torch.arange(start, start + tokens, dtype=torch.float32).view(tokens, 1, 1)
    return {layer: (pos.expand(tokens, HEADS, DIM).clone() + layer, -pos.expand(tokens, HEADS, DIM).clone())
            for layer in range(LAYERS)}


def cache(budget_bytes: int = 1 << 20, chunk: int = 4) -> BlockPrefixCache:
    return BlockPrefixCache("m@sha256:w", "cpu", "float32", chunk=chunk, budget_mib=budget_bytes / (1 << 20))


def fill(c: BlockPrefixCache, prompt: list[int], prefix_len: int, logits: Any = None) -> list[str]:
    """Store every block of ``prompt`` as its answer would; the last one gets ``logits``."""
    plan = c.plan(prompt, prefix_len, c.chunk)
    for i, key in enumerate(plan.keys):
        last = logits if i == len(plan) - 1 else None
        assert c.insert(key, plan.keys[i - 1] if i else None, plan.starts[i],
                        fake_kv(plan.starts[i], plan.ends[i] - plan.starts[i]), last)
    return list(plan.keys)


def test_blocks_are_the_scaffold_then_every_full_chunk_after_it() -> None:
    c = cache(chunk=4)
    plan = c.plan(list(range(100, 113)), 3, 4)  # N = 13, P = 3
    assert list(zip(plan.starts, plan.ends, strict=True)) == [(0, 3), (3, 7), (7, 11)]  # [11, 13) is no block
    assert plan.scaffold and plan.ending_at(7) == 1 and plan.ending_at(8) is None
    no_scaffold = c.plan(list(range(100, 113)), 0, 4)
    assert list(zip(no_scaffold.starts, no_scaffold.ends, strict=True)) == [(0, 4), (4, 8), (8, 12)]
    assert c.plan([1, 2, 3], 3, 4).ends == (3,)  # a prompt that is its scaffold: one block
    with pytest.raises(ValueError):
        c.plan([1, 2], 3, 4)


def test_a_key_names_every_token_before_it_the_chunking_and_the_model() -> None:
    c = cache(chunk=4)
    a = c.plan([1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23], 3, 4).keys
    same_start = c.plan([1, 2, 3, 10, 11, 12, 13, 30, 31, 32, 33], 3, 4).keys
    other_scaffold = c.plan([1, 2, 4, 10, 11, 12, 13, 20, 21, 22, 23], 3, 4).keys
    assert a[:2] == same_start[:2] and a[2] != same_start[2]
    assert set(a).isdisjoint(other_scaffold)  # same chunk ids after another scaffold: other keys
    assert c.plan([1, 2, 3, 10, 11, 12, 13], 3, 5).keys[0] != a[0]  # chunk size is in the root
    for other in (BlockPrefixCache("m@sha256:x", "cpu", "float32", chunk=4),
                  BlockPrefixCache("m@sha256:w", "cuda", "float32", chunk=4),
                  BlockPrefixCache("m@sha256:w", "cpu", "bfloat16", chunk=4)):
        assert other.plan([1, 2, 3], 3, 4).keys[0] != a[0]
    # block boundaries are part of the key: the same 8 ids as scaffold 3 + chunk vs scaffold 4 + chunk
    assert c.plan(list(range(8)), 3, 4).keys != c.plan(list(range(8)), 4, 4).keys


def test_the_longest_cached_chain_is_loaded_and_a_whole_prompt_needs_its_logits() -> None:
    c = cache(chunk=4)
    a = [1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 5]
    fill(c, a, 3)
    b = [1, 2, 3, 10, 11, 12, 13, 40, 41, 42, 43, 44, 45]
    got, cached, logits = c.match(c.plan(b, 3, 4), len(b))
    assert [g.start for g in got] == [0, 3] and cached == 7 and logits is None
    assert c.cached_tokens(b, 3) == 7 and c.cached_tokens(b, 0) == 0 and c.cached_tokens(b, 2) == 0
    # a prompt that ends on the last cached boundary: only with that block's logits
    whole = a[:11]
    assert c.cached_tokens(whole, 3) == 7  # the last block is computed again
    row = torch.tensor([0.5, 2.0])
    assert c.mark(c.plan(whole, 3, 4).keys[-1], row)
    got, cached, logits = c.match(c.plan(whole, 3, 4), len(whole))
    assert cached == 11 and torch.equal(logits, row)
    st = c.stats()
    assert (st.lookups, st.hits, st.cached_tokens, st.stored) == (2, 2, 18, 3)


def test_a_warm_lookup_loads_the_chain_without_counting_as_an_answers_lookup() -> None:
    c = cache(chunk=4)
    a = [1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 5]
    keys = fill(c, a, 3)
    other = fill(c, [7, 8, 9, 30, 31, 32, 33], 3)  # more recent than a's chain
    got, cached, _ = c.match(c.plan(a, 3, 4), len(a), count=False)
    assert cached == 11 and [g.key for g in got] == keys
    assert c.lru_keys()[-len(keys):] == keys[::-1] and c.lru_keys()[0] == other[-1]  # a's chain touched
    c.count_warm(8)
    st = c.stats()
    assert (st.lookups, st.hits, st.cached_tokens, st.warm_tokens) == (0, 0, 0, 8)


def test_a_block_whose_parent_is_not_cached_is_refused() -> None:
    c = cache(chunk=4)
    plan = c.plan([1, 2, 3, 10, 11, 12, 13], 3, 4)
    assert not c.insert(plan.keys[1], plan.keys[0], 3, fake_kv(3, 4), None)
    assert len(c) == 0 and c.bytes_used == 0


def test_bytes_are_counted_and_the_least_recently_used_leaf_goes_first() -> None:
    block = 4 * TOKEN_BYTES  # one 4-token block (the scaffold here is 4 tokens too)
    c = cache(budget_bytes=5 * block, chunk=4)
    a = fill(c, [1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17], 4)  # root, a1, a2
    b = fill(c, [1, 2, 3, 4, 10, 11, 12, 13, 30, 31, 32, 33], 4)  # shares root, a1; b2
    assert a[:2] == b[:2] and len(c) == 4 and c.bytes_used == 4 * block
    # LRU order keeps every ancestor more recent than its descendants: the front is a leaf
    assert c.lru_keys() == [a[2], b[2], a[1], a[0]]
    c.match(c.plan([1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17, 99], 4, 4), 13)  # a2 used again
    assert c.lru_keys() == [b[2], a[2], a[1], a[0]]
    d = fill(c, [1, 2, 3, 4, 50, 51, 52, 53, 54, 55, 56, 57], 4)  # two new blocks: one eviction
    assert b[2] not in c.lru_keys() and c.stats().evicted == 1
    assert c.bytes_used == 5 * block <= c.budget_bytes
    assert c.lru_keys()[-1] == a[0] and d[2] in c.lru_keys()


def test_a_block_larger_than_the_budget_is_not_kept_and_zero_keeps_nothing() -> None:
    c = cache(budget_bytes=3 * TOKEN_BYTES, chunk=4)
    assert not c.insert(c.plan([1, 2, 3, 4], 4, 4).keys[0], None, 0, fake_kv(0, 4), None)
    assert len(c) == 0
    z = cache(budget_bytes=0)
    assert not z.insert(z.plan([1], 1, 4).keys[0], None, 0, fake_kv(0, 1), None)
    assert z.cached_tokens([1, 2], 1) == 0


def test_random_traffic_stays_within_budget_and_every_cached_block_is_reachable() -> None:
    rnd = random.Random(7)
    c = cache(budget_bytes=9 * 4 * TOKEN_BYTES, chunk=4)
    heads = [[1, 2, 3, 4], [5, 6, 7, 8]]
    pages = [[100 + 4 * i + j for j in range(4)] for i in range(8)]
    for _ in range(300):
        prompt = rnd.choice(heads) + [t for p in rnd.sample(pages, rnd.randint(0, 3)) for t in p]
        plan = c.plan(prompt, 4, 4)
        got, cached, _ = c.match(plan, len(prompt))
        assert cached == (plan.ends[len(got) - 1] if got else 0)
        for i in range(len(got), len(plan)):
            c.insert(plan.keys[i], plan.keys[i - 1] if i else None, plan.starts[i],
                     fake_kv(plan.starts[i], 4), None)
        assert c.bytes_used <= c.budget_bytes
        held = set(c.lru_keys())
        for key in held:  # no orphan: a block's parent is held
            parent = c._blocks[key].parent
            assert parent is None or parent in held
            assert c._blocks[key].children == sum(1 for k in held if c._blocks[k].parent == key)
    assert c.stats().evicted > 0 and c.stats().hits > 0


def test_loading_a_chain_fills_the_buffer_with_the_stored_positions() -> None:
    c = cache(chunk=4)
    prompt = [1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 9]
    fill(c, prompt, 3)
    kv_cache = KVCache(blocks=c)
    got = kv_cache.admit(prompt, 3, max_new=2, chunk=4)
    assert got.cached_tokens == 11 and got.cached_blocks == 3 and got.first_logits is None
    assert got.kv.capacity == len(prompt) + 3
    want = fake_kv(0, 11)
    for layer in range(LAYERS):
        assert torch.equal(got.kv.k[layer][:11], want[layer][0])
        assert torch.equal(got.kv.v[layer][:11], want[layer][1])
        assert not got.kv.k[layer][11:].any()
    exported = got.kv.export_range(3, 7)
    assert torch.equal(exported[0][0], want[0][0][3:7])
    exported[0][0].add_(1)  # a private copy: the cache and the buffer keep theirs
    assert torch.equal(c._blocks[got.plan.keys[1]].kv[0][0], want[0][0][3:7])


def test_storing_a_block_restores_its_evicted_ancestors_from_the_answer_buffer() -> None:
    c = cache(chunk=4)
    kv_cache = KVCache(blocks=c)
    prompt = [1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23]
    plan = c.plan(prompt, 3, 4)
    seq = SeqKV(16)
    seq.load_blocks([])  # nothing to load
    for layer, (k, v) in fake_kv(0, 11).items():
        seq.k[layer] = torch.cat([k, torch.zeros(5, HEADS, DIM)])
        seq.v[layer] = torch.cat([v, torch.zeros(5, HEADS, DIM)])
    kv_cache.store_block(seq, plan, 2, torch.tensor([1.0]))  # blocks 0 and 1 were never stored
    assert c.lru_keys() == [plan.keys[2], plan.keys[1], plan.keys[0]]
    assert c._blocks[plan.keys[2]].last_logits is not None and c._blocks[plan.keys[0]].last_logits is None
    assert kv_cache.cached_tokens(prompt, 3, 4) == 11


def test_the_scaffold_view_answers_contains_get_and_put() -> None:
    c = cache(chunk=4)
    assert [1, 2] not in c and c.get([1, 2]) is None and "x" not in c
    stored = c.put([1, 2], fake_kv(0, 2), torch.tensor([3.0]))
    assert stored is not None and [1, 2] in c and (1, 2) in c and c.get([1, 2]) is stored
    assert c.cached_tokens([1, 2], 2) == 2 and c.cached_tokens([1, 2, 5], 2) == 2
    c.clear()
    assert len(c) == 0 and c.bytes_used == 0 and c.stats().stored == 0


def test_detokenizer_holds_back_incomplete_characters(smollm_tokenizer: Any) -> None:
    text = "Grüße 世界 🙂👍🏽 done"
    ids = smollm_tokenizer.encode(text)
    detok = IncrementalDetokenizer(smollm_tokenizer.decode)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas) and "" in deltas


def test_sampling_params_get_a_seed_and_greedy_ones_do_not() -> None:
    assert GenParams().resolved().seed is None
    sampled = GenParams(temperature=0.7).resolved()
    assert isinstance(sampled.seed, int) and sampled.resolved() == sampled
    assert GenParams(temperature=0.7, seed=5).resolved().seed == 5
