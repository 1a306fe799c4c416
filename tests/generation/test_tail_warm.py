"""Idle-time warm work: a finished turn's tail is prefilled into the block cache, exactly.

The packaged SmolLM2-135M (CPU, fp32) runs with 32-token prefill chunks and warm work on. An
answer that ends normally leaves a warm job over its prompt, its output and the template's end
of turn; the engine prefills it while idle. A follow-up that continues that turn then loads past
the earlier answer's tokens, and its output, and every block the warm job stored, are bit for
bit what a cold prefill of the follow-up computes. An answer that arrives during warm work
stops the warm chunk in progress (no warm step runs beside it); warm stores stay within the
cache's budget and leave pins alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.prompting.conversation import EarlierTurn, Turn
from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder, PromptChunk
from foundation.compute import call as compute_call
from generation.base import GenParams
from generation.engine.kv_cache import BlockPrefixCache
from tests.generation.test_kv_reuse import PARAGRAPHS  # the same three paragraphs first

pytestmark = pytest.mark.slow

CHUNK = 32
FIRST_NEW = 45  # the earlier answer's tokens: more than one block of them


@pytest.fixture(scope="module")
def gen(smollm_dir: Path, smollm_tokenizer: Any) -> Iterator[Any]:
    import torch

    from generation.local import LocalGenerator

    before = torch.get_num_threads()
    tokenizer_builder = PromptBuilder.for_tokenizer(smollm_tokenizer)
    g = LocalGenerator(smollm_dir, tokenizer=smollm_tokenizer, device="cpu", dtype="float32",
                       threads=1, prefill_chunk=CHUNK, step_token_budget=4 * CHUNK, warm_turns=8,
                       turn_close_ids=tokenizer_builder.turn_close_ids)
    yield g
    g.engine.close()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def builder(gen: Any) -> PromptBuilder:
    return PromptBuilder.for_generator(gen)


def wait_warm(gen: Any, timeout_s: float = 120.0) -> None:
    """Until the engine has no warm work left (it runs on the compute thread)."""
    deadline = time.monotonic() + timeout_s
    while gen.engine.warm_pending():
        assert time.monotonic() < deadline, "warm work did not finish"
        time.sleep(0.02)


def answer(gen: Any, ids: list[int], scaffold: int, max_new: int) -> tuple[list[int], int, Any]:
    """Greedy output ids (runs to ``max_new``: a normal end), cached tokens, the stream's stats."""
    stream = gen.stream(ids, cached_prefix_ids=ids[:scaffold],
                        params=GenParams(max_new_tokens=max_new, ignore_eos=True))
    tokens = [e.token_id for e in stream]
    assert stream.stats is not None and stream.stats.finish_reason == "length"
    return tokens, int(stream.stats.cached_tokens), stream.stats


def first_turn(builder: PromptBuilder) -> tuple[list[int], int]:
    p = builder.build(DEFAULT_SCAFFOLD_TEXT, [PromptChunk(i + 1, 1, PARAGRAPHS[i]) for i in (0, 1)],
                      "When is the pump station inspected?")
    return list(p.ids), p.scaffold_len


def follow_up(builder: PromptBuilder, ids: list[int], out: list[int]) -> list[int]:
    """The follow-up prompt as the answer pipeline lays it out (continuing the earlier turn)."""
    earlier = EarlierTurn("r-first", tuple(ids), tuple(out))
    p = builder.build(DEFAULT_SCAFFOLD_TEXT, [PromptChunk(1, 1, PARAGRAPHS[2])],
                      "And how long can the generator run?",
                      [Turn("user", "When is the pump station inspected?"), Turn("assistant", "x")],
                      earlier=earlier)
    assert list(p.ids[:len(ids) + len(out)]) == ids + out
    return list(p.ids)


def grid(n: int, scaffold: int) -> int:
    """The end of the last whole block of ``n`` tokens (blocks from the scaffold's end on)."""
    return scaffold + (n - scaffold) // CHUNK * CHUNK


def test_the_builders_turn_close_ids_are_what_a_follow_up_places_after_the_output(
        builder: PromptBuilder) -> None:
    ids, _ = first_turn(builder)
    close = builder.turn_close_ids
    assert close, "SmolLM2's template renders earlier assistant turns"
    full = follow_up(builder, ids, [42, 43])
    assert full[len(ids) + 2:len(ids) + 2 + len(close)] == close


def test_a_follow_up_loads_the_warmed_answer_and_equals_a_cold_prefill(gen: Any,
                                                                       builder: PromptBuilder) -> None:
    import torch

    ids, scaffold = first_turn(builder)
    gen.prefix_cache.clear()
    out, _, _ = answer(gen, ids, scaffold, FIRST_NEW)
    wait_warm(gen)
    close = list(builder.turn_close_ids or [])
    warmed = grid(len(ids) + len(out) + len(close), scaffold)
    assert warmed > grid(len(ids), scaffold) and warmed > len(ids)  # the answer's tokens are blocks now
    assert gen.prefix_cache.stats().warm_tokens >= warmed - grid(len(ids), scaffold)
    full = follow_up(builder, ids, out)
    plan = gen.prefix_cache.plan(full, scaffold, CHUNK)
    n_warm = plan.ends.index(warmed) + 1
    warm_blocks = {}
    with gen.prefix_cache._lock:  # the warm job's blocks, as stored
        for key in plan.keys[:n_warm]:
            warm_blocks[key] = gen.prefix_cache._blocks[key].kv
    warm_out, cached, _ = answer(gen, full, scaffold, 8)
    assert cached == warmed, (cached, warmed, len(ids) + len(out))
    wait_warm(gen)
    gen.prefix_cache.clear()
    cold_out, cold_cached, _ = answer(gen, full, scaffold, 8)
    assert cold_cached == 0
    assert warm_out == cold_out
    with gen.prefix_cache._lock:  # the cold prefill stored the same blocks, bit for bit
        for key, kv in warm_blocks.items():
            cold_kv = gen.prefix_cache._blocks[key].kv
            for layer, (k, v) in kv.items():
                assert torch.equal(k, cold_kv[layer][0]) and torch.equal(v, cold_kv[layer][1]), key
    wait_warm(gen)


def test_an_answer_arriving_during_warm_work_waits_for_one_chunk_at_most(gen: Any,
                                                                         builder: PromptBuilder) -> None:
    ids, scaffold = first_turn(builder)
    gen.prefix_cache.clear()
    wait_warm(gen)
    long_ids = ids + gen._synthetic_ids(24 * CHUNK)  # a long tail: many warm steps
    steps_before = gen.engine.warm_steps
    assert gen.engine.queue_warm(long_ids, scaffold, CHUNK)
    deadline = time.monotonic() + 60
    while gen.engine.warm_steps == steps_before:  # the warm job is under way
        assert time.monotonic() < deadline
        time.sleep(0.005)
    steps_before, aside_before = gen.engine.warm_steps, gen.engine.warm_set_aside
    t_submit = time.perf_counter()
    _, _, stats = answer(gen, ids, scaffold, 4)
    started = [s for s, _ in gen.engine.warm_log if t_submit < s < stats.first_token_t]
    assert len(started) <= 1, started  # at most the chunk decided on before the answer arrived
    assert gen.engine.warm_set_aside == aside_before + 1  # the warm job was set aside, not finished
    assert all(e <= stats.start_t or s >= stats.last_token_t  # none ran beside it
               for s, e in gen.engine.warm_log)
    wait_warm(gen)
    assert gen.engine.warm_steps > steps_before + 1  # and resumed afterwards
    assert gen.prefix_cache.cached_tokens(long_ids, scaffold, CHUNK) == grid(len(long_ids), scaffold)


def test_warm_work_stays_within_the_budget_and_leaves_pins_alone(
        gen: Any, builder: PromptBuilder, monkeypatch: pytest.MonkeyPatch) -> None:
    layers, kv_heads = int(gen.config.num_hidden_layers), int(gen.config.num_key_value_heads)
    head_dim = int(getattr(gen.config, "head_dim", gen.config.hidden_size // gen.config.num_attention_heads))
    block_mib = layers * 2 * kv_heads * head_dim * 4 * CHUNK / (1 << 20)  # one 32-token block, fp32
    wait_warm(gen)
    small = BlockPrefixCache(gen.prefix_cache.model_id, "cpu", "float32", chunk=CHUNK,
                             budget_mib=16 * block_mib)
    monkeypatch.setattr(gen, "prefix_cache", small)
    monkeypatch.setattr(gen.engine.kv_cache, "blocks", small)
    ids, scaffold = first_turn(builder)
    answer(gen, ids, scaffold, 4)
    pin = small.pin(ids, scaffold, CHUNK)  # the first prompt's chain, held against eviction
    try:
        pinned = set(pin.keys)
        assert pin.cached_tokens > scaffold
        for extra in (10, 20, 30):  # tails far longer than the cache
            assert gen.engine.queue_warm(ids + gen._synthetic_ids(extra * CHUNK), scaffold, CHUNK)
        wait_warm(gen)
        st = small.stats()
        assert st.warm_tokens > 0 and st.evicted > 0
        assert st.peak_bytes <= st.budget_bytes and st.bytes <= st.budget_bytes
        assert pinned <= set(small.lru_keys())
    finally:
        pin.release()


def test_the_warm_queue_keeps_the_newest_jobs_and_can_be_off(gen: Any, builder: PromptBuilder) -> None:
    import threading

    from generation.engine.core import Engine

    def bare(warm_turns: int) -> Engine:  # an engine on the same model, never attached
        return Engine(gen.model, "cpu", threading.Lock(), lambda ids: None, lambda *a: None, 1, CHUNK,
                      prefix_cache=gen.prefix_cache, warm_turns=warm_turns)

    wait_warm(gen)
    two = bare(2)

    def queue_four() -> list[int]:  # on the compute thread: no warm step runs in between
        for n in (3, 4, 5, 6):
            assert two.queue_warm(gen._synthetic_ids(n * CHUNK), 0, CHUNK)
        queued = two.warm_queue()
        two.close()  # drops what is queued: nothing is computed
        return queued

    assert compute_call(queue_four) == [6 * CHUNK, 5 * CHUNK]  # newest first, the oldest dropped
    assert not two.warm_pending()
    assert not bare(0).queue_warm(gen._synthetic_ids(4 * CHUNK), 0, CHUNK)  # off
    ids, scaffold = first_turn(builder)
    gen.prefix_cache.clear()
    gen.warm_turns = 0  # the generator's setting off: its answers leave no warm job
    try:
        answer(gen, ids, scaffold, FIRST_NEW)
        assert not gen.engine.warm_pending() and gen.prefix_cache.stats().warm_tokens == 0
    finally:
        gen.warm_turns = 8
