"""One answer's sampling can never end or change another answer in the same engine step.

The engine is the real one (:class:`generation.local.LocalGenerator` and its scheduler, the
real sampler :mod:`generation.sampling`) over the tiny random Llama of the scheduler tests,
saved to a directory, with a plain-id tokenizer (the model's vocabulary is 300 ids). Every
pair of answers here is queued before the engine's next step, so both share every step
until the shorter one ends.

The fuzz run draws every sampling parameter over its whole accepted range
(:meth:`GenParams.validate`: temperature in [0, 2] subnormals included, top_p in (0, 1],
any seed, ignore_eos, min_tokens in [0, max_new_tokens]) for an answer beside a greedy one:
the greedy answer's tokens are those it has alone, and no answer fails.
``RAGBUDGET_SAMPLING_FUZZ_EXAMPLES`` sets the example count (default 40, derandomized; any
other value draws at random: the longer run in docs/engines.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from foundation.errors import BackendError
from generation.base import MAX_SEED, GenParams
from generation.engine.messages import Finished, Token

FUZZ_EXAMPLES = int(os.environ.get("RAGBUDGET_SAMPLING_FUZZ_EXAMPLES", "40"))
DERANDOMIZE = "RAGBUDGET_SAMPLING_FUZZ_EXAMPLES" not in os.environ
MAX_NEW = 8
#: Ids that end an answer: one in ten of the vocabulary, so the random model often meets one
#: and ignore_eos / min_tokens have something to do.
STOP_IDS = list(range(2, 300, 10))
GREEDY_PROMPT = [7, 41, 99, 13, 250, 77, 5, 180, 64, 32, 9, 141, 201, 88, 19, 45, 73, 260, 11]


class PlainIds:
    """A tokenizer for a 300-id vocabulary: id ``n`` is the word ``tn``."""

    tokenizer_id = "test:plain-ids"

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        return "".join(f" t{i}" for i in ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The scheduler tests' tiny Llama (wider initial weights: peaked, varied logits) as a
    local generator: CPU, fp32, one thread, 16-token prefill chunks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from generation.local import LocalGenerator

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, initializer_range=0.5, eos_token_id=2,
                      bos_token_id=1)
    model_dir: Path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    before = torch.get_num_threads()
    gen = LocalGenerator(model_dir, tokenizer=PlainIds(), device="cpu", dtype="float32", threads=1,
                         stop_token_ids=STOP_IDS, max_running=4, step_token_budget=64,
                         prefill_chunk=16)
    yield gen
    torch.set_num_threads(before)


def run_together(gen: Any, *seqs: Any) -> list[tuple[list[int], str, BaseException | None]]:
    """Queue ``seqs`` before the engine's next step; each one's ``(tokens, finish reason,
    exception)`` once all ended."""
    engine = gen.engine
    with engine._state:  # the step loop waits: every answer joins the same first step
        for seq in seqs:
            engine.submit(seq)
    out = []
    for seq in seqs:
        tokens: list[int] = []
        while True:
            msg = seq.out.get(timeout=60)
            if isinstance(msg, Token):
                tokens.append(msg.token_id)
            elif isinstance(msg, Finished):
                out.append((tokens, msg.reason, msg.error))
                break
    return out


@pytest.fixture(scope="module")
def greedy_alone(tiny: Any) -> tuple[list[int], str]:
    """The greedy answer to GREEDY_PROMPT with nothing beside it."""
    ((tokens, reason, exc),) = run_together(tiny, tiny._sequence(GREEDY_PROMPT, 0, GenParams(MAX_NEW)))
    assert exc is None and (tokens, reason) == (tokens[:MAX_NEW], "length")  # shares every step
    return tokens, reason


def test_a_greedy_answer_beside_one_whose_sampling_raises_keeps_its_tokens_and_ends_ok(
        tiny: Any, greedy_alone: tuple[list[int], str]) -> None:
    """The neighbour's sampler raises at its third token, in a step the greedy answer shares:
    that answer alone ends with the error; the greedy one ends as it does alone."""
    greedy = tiny._sequence(GREEDY_PROMPT, 0, GenParams(MAX_NEW))
    bad = tiny._sequence([5, 6, 7, 8, 9], 0, GenParams(MAX_NEW, temperature=0.8, seed=1, ignore_eos=True))
    real, calls = bad.select, {"n": 0}

    def failing(logits: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("sampler fault in this answer")
        return int(real(logits))

    bad.select = failing
    tiny.engine.peak_rows_answers = 0
    (g_tokens, g_reason, g_exc), (b_tokens, b_reason, b_exc) = run_together(tiny, greedy, bad)
    assert tiny.engine.peak_rows_answers >= 2  # they shared steps
    assert (g_tokens, g_reason, g_exc) == (*greedy_alone, None)
    assert b_reason == "error" and isinstance(b_exc, RuntimeError) and len(b_tokens) == 2


def test_the_stream_of_an_answer_whose_sampling_fails_raises_a_backend_error(tiny: Any,
                                                                             monkeypatch: Any) -> None:
    """What the answer pipeline sees of such a failure: a BackendError from the stream (a
    ``failed`` receipt for that answer), after the tokens it had."""
    import generation.local as local

    real = local.select_token

    def failing(logits: Any, params: GenParams, rng: Any) -> int:
        if params.temperature == 0.25:
            raise RuntimeError("sampler fault")
        return int(real(logits, params, rng))

    monkeypatch.setattr(local, "select_token", failing)
    answer = tiny.stream([5, 6, 7], params=GenParams(4, temperature=0.25, seed=3))
    with pytest.raises(BackendError, match="sampler fault"):
        list(answer)
    assert answer.stats is not None and answer.stats.finish_reason == "error"


@st.composite
def sampling_params(draw: st.DrawFn) -> GenParams:
    """Every field over its whole accepted range (GenParams.validate), extremes included."""
    max_new = draw(st.integers(1, MAX_NEW))
    temperature = draw(st.one_of(
        st.just(0.0), st.floats(0.0, 2.0, allow_subnormal=True),
        st.floats(5e-324, 1e-30, allow_subnormal=True)))  # where float32 overflows
    return GenParams(max_new_tokens=max_new, temperature=temperature,
                     top_p=draw(st.floats(0.0, 1.0, exclude_min=True, allow_subnormal=True)),
                     seed=draw(st.none() | st.integers(0, MAX_SEED)),
                     ignore_eos=draw(st.booleans()), min_tokens=draw(st.integers(0, max_new)))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(params=sampling_params(),
       prompt=st.lists(st.integers(3, 299), min_size=1, max_size=40))
@example(params=GenParams(MAX_NEW, temperature=1e-40, seed=3), prompt=[5, 6, 7])
@example(params=GenParams(MAX_NEW, temperature=5e-324, top_p=5e-324, seed=MAX_SEED), prompt=[9])
@example(params=GenParams(MAX_NEW, temperature=2.0, min_tokens=MAX_NEW, ignore_eos=True), prompt=[4])
def test_fuzzed_sampling_beside_a_greedy_answer_never_fails_or_changes_it(
        tiny: Any, greedy_alone: tuple[list[int], str], params: GenParams, prompt: list[int]) -> None:
    params = params.validate().resolved()
    greedy = tiny._sequence(GREEDY_PROMPT, 0, GenParams(MAX_NEW))
    fuzzed = tiny._sequence(prompt, 0, params)
    (g_tokens, g_reason, g_exc), (f_tokens, f_reason, f_exc) = run_together(tiny, greedy, fuzzed)
    assert (g_tokens, g_reason, g_exc) == (*greedy_alone, None)
    assert f_exc is None and f_reason in ("stop", "length"), (f_reason, f_exc)
    stops = set(tiny.eos_token_ids)
    # What the run covered (shown by pytest --hypothesis-show-statistics).
    event("greedy" if params.greedy else "T < 1e-30 (float32 overflow path)"
          if params.temperature < 1e-30 else "sampled")
    if not params.greedy and params.top_p < 1.4e-45:
        event("top_p below float32's smallest value")
    event(f"fuzzed answer ended: {f_reason}")
    if params.ignore_eos and stops & set(f_tokens):
        event("ignore_eos: went on past a stop id")
    if params.min_tokens and f_reason == "stop":
        event("min_tokens: stopped only after min_tokens")
    if params.ignore_eos:  # runs to max_new_tokens whatever it meets
        assert f_reason == "length" and len(f_tokens) == params.max_new_tokens
    else:
        assert not stops & set(f_tokens) and len(f_tokens) <= params.max_new_tokens
    # min_tokens: no stop id among the first min_tokens tokens, and no stop before them
    assert not stops & set(f_tokens[:params.min_tokens])
    assert f_reason == "length" or len(f_tokens) >= params.min_tokens



def test_an_answer_whose_admission_or_scaffold_store_fails_ends_alone(
        tiny: Any, greedy_alone: tuple[list[int], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-answer work around the forward (the prefix cache lookup at admission, storing a
    computed scaffold) fails for one answer: that answer ends with the error, the greedy
    answer admitted in the same step ends as it does alone."""
    engine = tiny.engine
    blocks = engine.kv_cache.blocks
    blocks.clear()  # the faulty scaffold must be computed (and so stored) here
    plan, insert = blocks.plan, blocks.insert
    fault_key = plan([8, 9, 10], 2, tiny.prefill_chunk).keys[0]  # [8, 9]'s scaffold block

    def failing_plan(ids: list[int], prefix_len: int, chunk: int) -> Any:
        if ids[:2] == [5, 6]:
            raise RuntimeError("prefix cache lookup fault")
        return plan(ids, prefix_len, chunk)

    def failing_insert(key: str, *args: Any) -> bool:
        if key == fault_key:
            raise RuntimeError("prefix cache store fault")
        return insert(key, *args)

    monkeypatch.setattr(blocks, "plan", failing_plan)
    monkeypatch.setattr(blocks, "insert", failing_insert)
    greedy = tiny._sequence(GREEDY_PROMPT, 0, GenParams(MAX_NEW))
    no_admit = tiny._sequence([5, 6, 7], 2, GenParams(MAX_NEW))
    no_store = tiny._sequence([8, 9, 10], 2, GenParams(MAX_NEW))
    results = run_together(tiny, greedy, no_admit, no_store)
    assert results[0] == (*greedy_alone, None)
    assert [(r[1], str(r[2])) for r in results[1:]] == [
        ("error", "prefix cache lookup fault"), ("error", "prefix cache store fault")]
