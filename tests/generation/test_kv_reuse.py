"""Exact KV reuse beyond the scaffold: a warm prefill gives the tokens of a cold one.

The packaged SmolLM2-135M (CPU, fp32) runs with 32-token prefill chunks, so the retrieved
chunks of these prompts span several cache blocks. Prompts share the scaffold and some
leading retrieved chunks (and one is a follow-up turn that repeats an earlier prompt whole).
Each prompt is answered cold (empty prefix cache); then the cache is filled by the other
prompts in several orders and every prompt is answered again, alone and all together in one
batch: output token ids are identical, and the warm answers really loaded blocks past the
scaffold. The same holds with a budget of a few blocks, where eviction runs all the time.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder, PromptChunk
from generation.base import GenParams
from generation.engine.kv_cache import BlockPrefixCache

pytestmark = pytest.mark.slow

CHUNK = 32
MAX_NEW = 5
PARAGRAPHS = [
    "The pump station is inspected on the first Monday of every month. The engineer on duty "
    "records the pressure at each valve, checks the filters and writes the readings into the "
    "station log before noon.",
    "Valves are replaced every five years, or earlier when a pressure test shows a leak above "
    "two percent. Replacement parts are ordered from the regional depot and fitted by two "
    "technicians.",
    "The backup generator starts automatically when the mains supply fails for more than ten "
    "seconds. It runs on diesel and its tank holds enough fuel for three days of operation.",
    "Filters are cleaned every week and replaced every six months. A clogged filter raises the "
    "pressure drop across the pump, which the control room sees as an alarm on the main panel.",
    "Visitors must sign in at the gate, wear a helmet and stay with an escort at all times. "
    "Photography inside the turbine hall is not allowed without written permission.",
]
#: (retrieved paragraphs in order, question): pairs share the scaffold and leading chunks
CASES = [
    ([0, 1], "When is the pump station inspected?"),
    ([0, 1], "How often are valves replaced?"),
    ([0, 1, 3], "What does a clogged filter do?"),
    ([0, 2], "How long can the generator run?"),
    ([4], "May visitors take photographs?"),
]


@pytest.fixture(scope="module")
def gen(smollm_dir: Path, smollm_tokenizer: Any) -> Iterator[Any]:
    import torch

    from generation.local import LocalGenerator

    before = torch.get_num_threads()
    g = LocalGenerator(smollm_dir, tokenizer=smollm_tokenizer, device="cpu", dtype="float32",
                       threads=1, prefill_chunk=CHUNK, step_token_budget=4 * CHUNK)
    yield g
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts(gen: Any) -> list[tuple[list[int], int]]:
    """``(ids, scaffold length)`` per case, plus a follow-up turn of the first case: its whole
    prompt, an answer and a new question (the earlier turn is its exact prefix)."""
    builder = PromptBuilder.for_generator(gen)
    out = []
    for paras, question in CASES:
        p = builder.build(DEFAULT_SCAFFOLD_TEXT, [PromptChunk(i + 1, 1, PARAGRAPHS[i]) for i in paras],
                          question)
        out.append((list(p.ids), p.scaffold_len))
    first, scaffold = out[0]
    follow_up = first + builder.encode_plain("On the first Monday of every month. And the valves?")
    out.append((follow_up, scaffold))
    # A prompt that ends exactly on a block boundary: served whole from the cache once its
    # last block's logits are there (the second time it is asked).
    whole = first[:scaffold + 2 * CHUNK]
    out.append((whole, scaffold))
    return out


def answer(gen: Any, ids: list[int], scaffold: int) -> tuple[list[int], int]:
    """Greedy output ids and the prompt tokens taken from the cache."""
    stream = gen.stream(ids, cached_prefix_ids=ids[:scaffold],
                        params=GenParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    tokens = [e.token_id for e in stream]
    assert stream.stats is not None
    return tokens, int(stream.stats.cached_tokens)


def answer_together(gen: Any, prompts: list[tuple[list[int], int]]) -> list[list[int]]:
    """All prompts at once (each stream on its own thread; they share engine steps)."""
    out: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = answer(gen, *prompts[i])[0]
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    gen.engine.peak_rows_answers = 0
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and gen.engine.peak_rows_answers >= 2
    return [out[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def cold(gen: Any, prompts: list[tuple[list[int], int]]) -> list[list[int]]:
    """Every prompt's answer from an empty cache."""
    out = []
    for ids, scaffold in prompts:
        gen.prefix_cache.clear()
        tokens, cached = answer(gen, ids, scaffold)
        assert cached == 0 and len(tokens) == MAX_NEW
        out.append(tokens)
    return out


def test_the_prompts_share_blocks_past_the_scaffold(gen: Any, prompts: list[tuple[list[int], int]]) -> None:
    plans = [gen.prefix_cache.plan(ids, p, CHUNK) for ids, p in prompts]
    assert len(set(plans[0].keys) & set(plans[1].keys)) >= 3  # scaffold + >= 2 chunk blocks
    assert set(plans[0].keys) <= set(plans[5].keys)  # the follow-up repeats the first turn whole
    assert len(set(plans[0].keys) & set(plans[4].keys)) == 1  # only the scaffold


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_warm_answers_equal_cold_ones_whatever_filled_the_cache(
        gen: Any, prompts: list[tuple[list[int], int]], cold: list[list[int]], seed: int) -> None:
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    gen.prefix_cache.clear()
    past_scaffold = 0
    for i in order:  # each prompt after those before it in this order filled the cache
        tokens, cached = answer(gen, *prompts[i])
        assert tokens == cold[i], f"prompt {i} changed warm (order {order})"
        past_scaffold += cached > prompts[i][1]
    again = [answer(gen, *p) for p in prompts]  # now every block of every prompt is cached
    assert [t for t, _ in again] == cold
    assert past_scaffold >= 2
    for (ids, scaffold), (_, cached) in zip(prompts, again, strict=True):
        assert cached == gen.prefix_cache.cached_tokens(ids, scaffold, CHUNK) > 0
        assert cached >= len(ids) - CHUNK  # all but the last partial chunk (or the whole prompt)
    assert again[-1][1] == len(prompts[-1][0])  # ends on a boundary: served whole, first token included


def test_warm_answers_batched_together_equal_cold_ones(
        gen: Any, prompts: list[tuple[list[int], int]], cold: list[list[int]]) -> None:
    gen.prefix_cache.clear()
    for i in (1, 3):  # part of the traffic warmed the cache; the rest shares blocks with it
        answer(gen, *prompts[i])
    assert answer_together(gen, prompts) == cold
    assert answer_together(gen, prompts) == cold  # every block cached now


def test_a_cache_of_a_few_blocks_evicts_and_stays_exact(
        gen: Any, prompts: list[tuple[list[int], int]], cold: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    layers, kv_heads = int(gen.config.num_hidden_layers), int(gen.config.num_key_value_heads)
    head_dim = int(getattr(gen.config, "head_dim", gen.config.hidden_size // gen.config.num_attention_heads))
    block_mib = layers * 2 * kv_heads * head_dim * 4 * CHUNK / (1 << 20)  # one 32-token block, fp32
    small = BlockPrefixCache(gen.prefix_cache.model_id, "cpu", "float32", chunk=CHUNK,
                             budget_mib=6 * block_mib)
    monkeypatch.setattr(gen, "prefix_cache", small)
    monkeypatch.setattr(gen.engine.kv_cache, "blocks", small)
    rnd = random.Random(5)
    for _ in range(2):
        order = [rnd.randrange(len(prompts)) for _ in range(10)]
        for i in order:
            assert answer(gen, *prompts[i])[0] == cold[i], f"prompt {i} changed under eviction"
            assert small.bytes_used <= small.budget_bytes
    assert answer_together(gen, prompts) == cold
    st = small.stats()
    assert st.evicted > 0 and st.hits > 0 and st.bytes <= st.budget_bytes


def first_logits(gen: Any, ids: list[int], scaffold: int) -> tuple[Any, int]:
    """The next-token logits ``(vocab,)`` after ``ids`` through the engine, and the tokens the
    prefix cache gave."""
    seen: list[Any] = []
    seq = gen._sequence(list(ids), scaffold, GenParams(max_new_tokens=1))
    seq.select = lambda logits: seen.append(logits.clone()) or 0
    with gen._lock:
        gen.engine.run_alone(seq)
    return seen[-1], seq.cached_tokens


def test_warm_next_token_logits_are_bit_identical_to_cold_ones(
        gen: Any, prompts: list[tuple[list[int], int]]) -> None:
    import torch

    past_scaffold = 0
    for i, (ids, scaffold) in enumerate(prompts):
        gen.prefix_cache.clear()
        cold_logits, cached = first_logits(gen, ids, scaffold)
        assert cached == 0
        gen.prefix_cache.clear()
        for j in [*range(i + 1, len(prompts)), *range(i)]:  # the others fill the cache first
            first_logits(gen, *prompts[j])
        warm_logits, cached = first_logits(gen, ids, scaffold)
        assert cached >= scaffold  # every prompt shares at least the scaffold
        past_scaffold += cached > scaffold
        assert torch.equal(cold_logits, warm_logits), f"prompt {i}: warm logits differ ({cached} cached)"
    assert past_scaffold >= 4
