"""The prefix KV cache store (fake KV objects) and the incremental detokenizer."""

from __future__ import annotations

from typing import Any

from generation.base import GenParams, IncrementalDetokenizer
from generation.engine.kv_cache import PrefixKVCache


def compute(ids: list[int]) -> tuple[Any, Any]:
    return {"kv": list(ids)}, max(ids)


def test_a_prefix_is_computed_once_then_served_from_the_cache() -> None:
    cache = PrefixKVCache("m", "cpu", "float32")
    calls: list[list[int]] = []

    def counting(ids: list[int]) -> tuple[Any, Any]:
        calls.append(ids)
        return compute(ids)

    first, hit1 = cache.get_or_compute([1, 2, 3], counting)
    second, hit2 = cache.get_or_compute([1, 2, 3], counting)
    assert (hit1, hit2) == (False, True) and second is first and len(calls) == 1
    assert first.hits == 1 and first.compute_ms >= 0


def test_copies_are_private_so_the_stored_cache_is_never_mutated() -> None:
    cache = PrefixKVCache("m", "cpu", "float32")
    entry, _ = cache.get_or_compute([1, 2], compute)
    copy = PrefixKVCache.copy_kv(entry)
    copy["kv"].append(99)
    assert entry.kv == {"kv": [1, 2]}


def test_least_recently_used_prefix_is_evicted_first() -> None:
    cache = PrefixKVCache("m", "cpu", "float32", capacity=2)
    cache.get_or_compute([1], compute)
    cache.get_or_compute([2], compute)
    cache.get([1])
    cache.get_or_compute([3], compute)
    assert [1] in cache and [3] in cache and [2] not in cache and len(cache) == 2


def test_key_names_the_prefix_hash_model_device_and_dtype() -> None:
    a = PrefixKVCache("m", "cpu", "float32").key([1, 2])
    assert a[0].startswith("sha256:") and a[1:] == ("m", "cpu", "float32")
    assert PrefixKVCache("m", "cuda", "bfloat16").key([1, 2]) != a
    assert PrefixKVCache("m", "cpu", "float32").key([1, 3]) != a


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
