"""What a remote engine's prefix cache holds, learned from the cached-token counts it reports."""

from __future__ import annotations

from typing import Any

import pytest

from generation.base import GenParams
from generation.remote import RemoteGenerator
from generation.remote_cache import RemotePrefixMemory, common_prefix
from generation.remote_tokenizer import load_tiktoken
from tests.generation.fake_openai import FakeOpenAI

PIECES = ["The pump", " is", " inspected", "."]


@pytest.fixture(scope="module")
def tiktok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tiktoken("cl100k_base", tmp_path_factory.mktemp("data"))


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([7], [8]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


def test_before_learning_only_the_scaffold_is_assumed() -> None:
    m = RemotePrefixMemory(min_samples=2)
    m.remember([1, 2, 3, 4, 5, 6])
    assert m.expected([1, 2, 3, 4, 9]) == 4
    assert m.predict([1, 2, 3, 4, 9], prefix_len=2) == 2   # no hit past the scaffold yet
    assert m.predict([9, 9], prefix_len=2) == 0           # nothing shared: nothing cached


def test_an_engine_that_serves_every_shared_prefix_is_predicted_to() -> None:
    m = RemotePrefixMemory(min_samples=2)
    m.remember([1, 2, 3, 4, 5, 6])
    for _ in range(2):
        m.observe(expected=6, reported=6)
    assert m.hit_ratio() == 1.0
    assert m.predict([1, 2, 3, 4, 5, 6, 7], prefix_len=2) == 6


def test_an_engine_that_gives_no_hits_is_assumed_to_give_none_scaffold_included() -> None:
    m = RemotePrefixMemory(min_samples=3)
    m.remember([1, 2, 3, 4])
    for _ in range(3):
        m.observe(expected=4, reported=0)
    assert m.hit_ratio() == 0.0
    assert m.predict([1, 2, 3, 4, 5], prefix_len=2) == 0


def test_a_partial_cache_is_priced_by_its_ratio_and_the_window_forgets() -> None:
    m = RemotePrefixMemory(min_samples=2, window=4)
    m.remember(list(range(100)))
    m.observe(100, 50)
    m.observe(100, 50)
    assert m.predict(list(range(100)), prefix_len=10) == 50
    for _ in range(4):                       # the engine's cache grew: four full hits
        m.observe(100, 100)
    assert m.hit_ratio() == 1.0
    m.observe(0, 0)                          # nothing expected: teaches nothing
    m.observe(10, 25)                        # more than this process sent: clamped
    assert m.samples == 4 and m.hit_ratio() == 1.0


def test_oldest_prompt_is_forgotten_past_the_limit() -> None:
    m = RemotePrefixMemory(max_prompts=2)
    for ids in ([1, 1], [2, 2], [3, 3]):
        m.remember(ids)
    assert m.expected([1, 1]) == 0 and m.expected([3, 3]) == 2 and m.status()["prompts"] == 2
    with pytest.raises(ValueError):
        RemotePrefixMemory(window=0)


def test_the_generator_learns_from_the_servers_usage_counts(tiktok: Any) -> None:
    prompt = list(range(100, 140))
    with FakeOpenAI(PIECES, cached_tokens=0) as server:   # a server that caches nothing
        gen = RemoteGenerator(server.base_url, "fake-model", tokenizer=tiktok)
        first = gen.stream(prompt, cached_prefix_ids=prompt[:8], params=GenParams(max_new_tokens=4))
        list(first)
        assert first.stats is not None and first.stats.cache_reported
        assert gen.cached_tokens(prompt, 8, 1) == 8        # nothing learned yet: the scaffold
        assert gen.prefix_cached(prompt[:8])
        for _ in range(4):
            list(gen.stream(prompt, params=GenParams(max_new_tokens=4)))
        assert gen.prefix_memory.samples == 4 and gen.prefix_memory.hit_ratio() == 0.0
        assert gen.cached_tokens(prompt, 8, 1) == 0        # it said it reused nothing, four times
        assert not gen.prefix_cached(prompt[:8])
    with FakeOpenAI(PIECES, cached_tokens=40) as server:  # a server that serves the whole prompt
        gen = RemoteGenerator(server.base_url, "fake-model", tokenizer=tiktok)
        for _ in range(5):
            list(gen.stream(prompt, params=GenParams(max_new_tokens=4)))
        assert gen.prefix_memory.hit_ratio() == 1.0
        assert gen.cached_tokens(prompt + [7, 7], 8, 1) == 40


def test_common_prefix_matches_an_element_by_element_walk() -> None:
    import random

    def walk(a: list[int], b: list[int]) -> int:
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    rng = random.Random(7)
    for _ in range(300):
        base = [rng.randrange(50_000) for _ in range(rng.randrange(0, 300))]
        cut = rng.randrange(0, len(base) + 1)
        other = base[:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(0, 40))]
        assert common_prefix(base, other) == walk(base, other)
        assert common_prefix(other, base) == walk(other, base)
    m = RemotePrefixMemory()
    m.remember([5, 6, 7, 8])
    m.remember([5, 6, 9])
    assert m.expected([5, 6, 7, 1]) == 3 and m.expected([4]) == 0 and m.expected([]) == 0
