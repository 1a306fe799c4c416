"""The local SmolLM2 backend: cached prefix == full prefill, streaming, cancel, sampling, timers."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
import torch

from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder, PromptChunk
from foundation.errors import InvalidInput, TooLarge
from generation.base import Generator, GenParams

pytestmark = pytest.mark.slow


@pytest.fixture
def g(local_generator: Any) -> Any:
    return local_generator


@pytest.fixture(scope="module")
def prompt(local_generator: Any) -> Any:
    builder = PromptBuilder.for_generator(local_generator)
    chunks = [PromptChunk(1, 1, "The pump station is inspected on the first Monday of every month."),
              PromptChunk(2, 3, "Valves are replaced every five years.")]
    return builder.build(DEFAULT_SCAFFOLD_TEXT, chunks, "When is the pump station inspected?")


def test_local_generator_satisfies_the_protocol(g: Any) -> None:
    assert isinstance(g, Generator)
    ident = g.identity
    assert ident["backend"] == "local" and ident["weights_hash"].startswith("sha256:")
    assert (ident["device"], ident["dtype"], ident["threads"]) == ("cpu", "float32", 1)
    assert g.eos_token_ids == [2] and g.context_window == 8192


def _first_logits(g: Any, ids: list[int], prefix_len: int) -> Any:
    """Next-token logits after ``ids`` through the engine (prefix from the cache when held)."""
    seen: list[Any] = []
    seq = g._sequence(list(ids), prefix_len, GenParams(max_new_tokens=1))
    seq.select = lambda logits: seen.append(logits.clone()) or 0
    with g._lock:
        g.engine.run_alone(seq)
    return seen[-1]


def test_next_token_logits_after_a_cached_prefix_equal_a_full_prefill(g: Any, prompt: Any) -> None:
    full = _first_logits(g, prompt.ids, 0)
    g.warm_prefix(prompt.scaffold_ids)
    cached = _first_logits(g, prompt.ids, prompt.scaffold_len)
    assert int(torch.argmax(full)) == int(torch.argmax(cached))
    assert torch.allclose(full, cached, atol=1e-3, rtol=0)


def test_a_cache_hit_and_a_miss_compute_the_same_bits(g: Any, prompt: Any) -> None:
    g.prefix_cache.clear()
    miss = _first_logits(g, prompt.ids, prompt.scaffold_len)
    assert g.prefix_cached(prompt.scaffold_ids)
    hit = _first_logits(g, prompt.ids, prompt.scaffold_len)
    assert torch.equal(miss, hit)


def test_greedy_answer_is_identical_with_and_without_the_prefix_cache(g: Any, prompt: Any) -> None:
    params = GenParams(max_new_tokens=12)
    cold = [e.token_id for e in g.stream(prompt.ids, cached_prefix_ids=None, params=params)]
    g.warm_prefix(prompt.scaffold_ids)
    answer = g.stream(prompt.ids, cached_prefix_ids=prompt.scaffold_ids, params=params)
    warm = [e.token_id for e in answer]
    stats = answer.stats
    assert warm == cold and len(cold) > 0
    assert stats.cached_tokens == prompt.scaffold_len
    assert stats.computed_tokens == prompt.prompt_tokens - prompt.scaffold_len
    assert stats.output_token_ids == warm


def test_requests_never_mutate_the_stored_prefix(g: Any, prompt: Any) -> None:
    g.warm_prefix(prompt.scaffold_ids)
    entry = g.prefix_cache.get(prompt.scaffold_ids)
    before = {layer: (k.clone(), v.clone()) for layer, (k, v) in entry.kv.items()}
    list(g.stream(prompt.ids, cached_prefix_ids=prompt.scaffold_ids, params=GenParams(max_new_tokens=3)))
    assert g.prefix_cached(prompt.scaffold_ids)
    assert len(before) == g.config.num_hidden_layers
    for layer, (k, v) in before.items():
        assert k.shape[0] == prompt.scaffold_len
        assert torch.equal(entry.kv[layer][0], k) and torch.equal(entry.kv[layer][1], v)


def test_a_cold_scaffold_is_stored_but_not_counted_as_cached(g: Any, prompt: Any) -> None:
    g.prefix_cache.clear()
    answer = g.stream(prompt.ids, cached_prefix_ids=prompt.scaffold_ids, params=GenParams(max_new_tokens=1))
    list(answer)
    assert answer.stats.cached_tokens == 0 and g.prefix_cached(prompt.scaffold_ids)


def test_stream_events_carry_text_and_increasing_times(g: Any, prompt: Any) -> None:
    answer = g.stream(prompt.ids, cached_prefix_ids=None, params=GenParams(max_new_tokens=6))
    events = list(answer)
    stats = answer.stats
    assert [e.index for e in events] == list(range(len(events)))
    assert all(a.t <= b.t for a, b in zip(events, events[1:], strict=False))
    assert "".join(e.text for e in events) == g.tokenizer.decode(stats.output_token_ids)
    assert stats.finish_reason in ("stop", "length") and stats.prefill_ms > 0
    assert stats.first_token_t == events[0].t and stats.last_token_t == events[-1].t


def test_the_engine_shows_the_answer_once_stream_returns(g: Any, prompt: Any) -> None:
    """``stream()`` queues the answer in the engine before it returns, before any ``next()``."""
    with g._lock:  # no step runs meanwhile: the snapshot sees the answer as it was queued
        answer = g.stream(prompt.ids, cached_prefix_ids=None, params=GenParams(max_new_tokens=2))
        seen = g.engine.batch_snapshot()
    events = list(answer)
    assert len(events) == 2 and answer.stats is not None and answer.stats.output_tokens == 2
    # In the queue, nothing computed yet: tokens left, position, max_new (and a prefill order).
    assert seen.decoding == ()
    assert [(e.tokens_left, e.position, e.max_new) for e in seen.prefilling] == [(len(prompt.ids), 0, 2)]


def test_answers_prefill_in_the_order_their_streams_were_started(g: Any, prompt: Any) -> None:
    """The engine owns the waiting line: an answer started first prefills first, even when the
    one started after it is read first."""
    first = g.stream(prompt.ids, cached_prefix_ids=None, params=GenParams(max_new_tokens=1))
    second = g.stream(prompt.ids[:40], cached_prefix_ids=None, params=GenParams(max_new_tokens=1))
    assert len(list(second)) == 1 and len(list(first)) == 1
    assert first.stats is not None and second.stats is not None
    assert first.stats.first_token_t is not None and second.stats.first_token_t is not None
    assert first.stats.first_token_t <= second.stats.first_token_t


def test_max_new_tokens_ends_with_length(g: Any, prompt: Any) -> None:
    answer = g.stream(prompt.ids, cached_prefix_ids=None, params=GenParams(max_new_tokens=2))
    events = list(answer)
    assert len(events) == 2 and answer.stats.finish_reason == "length"


def test_cancel_between_tokens_stops_within_one_token(g: Any, prompt: Any) -> None:
    cancel = threading.Event()
    seen = 0
    answer = g.stream(prompt.ids, cached_prefix_ids=None, params=GenParams(max_new_tokens=40), cancel=cancel)
    for _ in answer:
        seen += 1
        if seen == 2:
            cancel.set()
    stats = answer.stats
    assert seen == 2 and stats.finish_reason == "cancelled" and len(stats.output_token_ids) == 2


def test_cancel_before_prefill_generates_nothing(g: Any, prompt: Any) -> None:
    cancel = threading.Event()
    cancel.set()
    answer = g.stream(prompt.ids, cached_prefix_ids=None, params=GenParams(), cancel=cancel)
    events = list(answer)
    assert events == [] and answer.stats.finish_reason == "cancelled"


def test_closing_the_stream_records_a_cancelled_answer_and_frees_the_model(
        g: Any, prompt: Any) -> None:
    it = g.stream(prompt.ids, cached_prefix_ids=None, params=GenParams(max_new_tokens=40))
    next(it)
    it.close()
    assert it.stats.finish_reason == "cancelled"
    assert g._lock.acquire(blocking=False)
    g._lock.release()


def test_sampling_with_the_same_seed_repeats(g: Any, prompt: Any) -> None:
    params = GenParams(max_new_tokens=6, temperature=0.9, top_p=0.9)
    answer = g.stream(prompt.ids, cached_prefix_ids=None, params=params)
    first = [e.token_id for e in answer]
    seed = answer.stats.params.seed
    again = [e.token_id for e in g.stream(prompt.ids, cached_prefix_ids=None,
                                                        params=GenParams(6, 0.9, 0.9, seed))]
    assert isinstance(seed, int) and first == again


def test_prompt_that_fills_the_context_window_is_rejected(g: Any) -> None:
    with pytest.raises(TooLarge):
        g.stream([5] * g.context_window, cached_prefix_ids=None, params=GenParams())


def test_calibration_timers_return_milliseconds(g: Any) -> None:
    assert g.prefill_ms(48, 0) > 0 and g.prefill_ms(48, 32) > 0 and g.decode_step_ms(48) > 0
    with pytest.raises(InvalidInput):  # no decode step fits after window - 1 tokens
        g.decode_step_ms(g.context_window - 1)
    assert g.prefix_cache.bytes_used <= g.prefix_cache.budget_bytes


def test_prefill_timer_times_a_scaffold_miss_and_refuses_a_bad_boundary(g: Any) -> None:
    assert g.prefill_ms(120, 0, prefix_tokens=40) > 0
    with pytest.raises(InvalidInput):
        g.prefill_ms(120, 40, prefix_tokens=80)  # a hit's boundary is its cached length
    with pytest.raises(InvalidInput):
        g.prefill_ms(120, 0, prefix_tokens=121)


def test_a_scaffold_miss_runs_its_scaffold_then_exactly_the_steps_of_a_hit(g: Any) -> None:
    from benchmarks.prefix_cache import step_saving

    miss: list[Any] = []
    hit: list[Any] = []
    miss_ms = g.prefill_ms(120, 0, prefix_tokens=40, steps=miss)
    hit_ms = g.prefill_ms(120, 40, steps=hit)
    assert [st.segments for st in miss] == [((40, 0),), ((80, 40),)]
    assert [(st.segments, st.logit_rows) for st in hit] == [(((80, 40),), 1)]
    assert miss[1].logit_rows == hit[0].logit_rows and sum(st.ms for st in miss) <= miss_ms
    saving = step_saving(40, miss, hit, miss_ms, hit_ms)
    assert saving is not None and math.isfinite(saving)
    # the saving's outside-step terms come from the same calls: here they are exact
    assert math.isclose(saving, miss[0].ms + (miss_ms - miss[0].ms - miss[1].ms) - (hit_ms - hit[0].ms))
    # a hit that ran other steps is not paired with this miss
    other: list[Any] = []
    other_ms = g.prefill_ms(150, 40, steps=other)
    assert step_saving(40, miss, other, miss_ms, other_ms) is None


def test_step_timer_times_a_mixed_step_and_checks_its_shape(g: Any) -> None:
    assert g.step_ms(32, 100, [50, 300]) > 0
    assert g.step_ms(0, 0, [20], prefill_needs_logits=False) > 0
    assert g.step_ms(16, 0, [], prefill_needs_logits=False) > 0
    with pytest.raises(InvalidInput):
        g.step_ms(0, 0, [])
    with pytest.raises(InvalidInput):
        g.step_ms(0, 0, [10] * (g.max_running + 1))


def test_config_dict_has_the_roofline_fields(g: Any) -> None:
    cfg = g.config_dict()
    assert cfg["num_hidden_layers"] == 30 and cfg["num_key_value_heads"] == 3
    assert 100_000_000 < cfg["num_parameters"] < 200_000_000 and cfg["vocab_size"] == 49152


def _eos_answer(g: Any, prompt: Any, **kw: Any) -> tuple[list[int], str]:
    answer = g.stream(prompt.ids, cached_prefix_ids=prompt.scaffold_ids, params=GenParams(**kw))
    ids = [e.token_id for e in answer]
    return ids, answer.stats.finish_reason


def test_ignore_eos_goes_on_past_end_of_text_to_max_tokens(g: Any, prompt: Any) -> None:
    """vLLM's ``ignore_eos``: the end-of-text token is output like any other and the answer
    runs to ``max_new_tokens``; the tokens before it are those of the plain answer."""
    plain, why = _eos_answer(g, prompt, max_new_tokens=24)
    assert why == "stop" and len(plain) < 21
    longer, why = _eos_answer(g, prompt, max_new_tokens=len(plain) + 3, ignore_eos=True)
    assert why == "length" and len(longer) == len(plain) + 3
    assert longer[:len(plain)] == plain and longer[len(plain)] in g.eos_token_ids


def test_min_tokens_masks_end_of_text_until_that_many_tokens(g: Any, prompt: Any) -> None:
    """vLLM's ``min_tokens``: end-of-text is masked out (logit -inf) until ``min_tokens``
    tokens were generated; before the plain answer's end nothing changes (same argmax)."""
    plain, _ = _eos_answer(g, prompt, max_new_tokens=24)
    want = len(plain) + 2
    masked, _ = _eos_answer(g, prompt, max_new_tokens=want + 1, min_tokens=want)
    assert masked[:len(plain)] == plain and len(masked) >= want
    assert not set(masked[:want]) & set(g.eos_token_ids)
