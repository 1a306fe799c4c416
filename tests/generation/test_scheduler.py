"""The packed engine computes what the model's own eager attention computes (tiny random models).

Gemma 3 with sliding-window layers and Llama, prompts prefilled in chunks shorter than the
prompt and longer than the window: the last logits match a plain full-sequence forward.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from generation.engine.core import Engine
from generation.engine.messages import BatchSnapshot, Finished, Prefilling
from generation.engine.request import Request as Sequence
from generation.engine.scheduler import padded_rows
from generation.packed_attention import ATTN_NAME, register_packed_attention


def _tiny(kind: str) -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    if kind == "gemma3":
        cfg: Any = Gemma3TextConfig(**common, sliding_window=8,
                                    layer_types=["sliding_attention", "sliding_attention", "full_attention"])
        model: Any = Gemma3ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(**common)
        model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_chunked_packed_prefill_matches_a_full_eager_forward(kind: str) -> None:
    model = _tiny(kind)
    ids = torch.randint(5, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits[0, -1]
    register_packed_attention()
    model.config._attn_implementation = ATTN_NAME
    got: list[Any] = []
    engine = Engine(model, "cpu", threading.Lock(), lambda _ids: None, lambda *_a: None, 4, 256)
    seq = Sequence(prompt=ids[0].tolist(), prefix_len=0, max_new=1, chunk=16,
                   select=lambda logits: got.append(logits.clone()) or 0, eos=frozenset())
    engine.run_alone(seq)
    assert torch.allclose(want, got[-1], atol=1e-4, rtol=0)


def test_padded_rows_rule() -> None:
    assert [padded_rows(n) for n in (1, 9, 16, 17, 24, 25)] == [16, 16, 16, 24, 24, 32]
    assert padded_rows(5, fixed=320) == 320 and padded_rows(400, fixed=320) == 400


def test_prefill_only_steps_skip_the_lm_head() -> None:
    """A step whose chunks need no logits (mid-prompt) runs no LM-head rows; the step that
    ends the prompt runs them padded to ``padded_rows``."""
    model = _tiny("llama")
    register_packed_attention()
    model.config._attn_implementation = ATTN_NAME
    head_rows: list[int] = []
    model.lm_head.register_forward_hook(lambda _m, inp, _out: head_rows.append(int(inp[0].shape[1])))
    engine = Engine(model, "cpu", threading.Lock(), lambda _ids: None, lambda *_a: None, 4, 256)
    seq = Sequence(prompt=list(range(5, 45)), prefix_len=0, max_new=1, chunk=16,
                   select=lambda _logits: 0, eos=frozenset())
    engine.run_alone(seq)
    assert engine.steps == 3  # chunks [0,16), [16,32), [32,40)
    assert head_rows == [0, 0, padded_rows(1)]


def test_every_step_is_logged_with_its_shape_and_time() -> None:
    """The step log (what the planner reads the machine's speed from) holds each step's
    segments ``(new tokens, start)``, logit rows and a positive wall time, oldest first."""
    model = _tiny("llama")
    register_packed_attention()
    model.config._attn_implementation = ATTN_NAME
    engine = Engine(model, "cpu", threading.Lock(), lambda _ids: None, lambda *_a: None, 4, 256)
    seq = Sequence(prompt=list(range(5, 45)), prefix_len=0, max_new=3, chunk=16,
                   select=lambda _logits: 7, eos=frozenset())
    engine.run_alone(seq, decode_steps=2)
    log = engine.recent_steps()
    assert [(r.segments, r.logit_rows) for r in log] == [
        (((16, 0),), 0), (((16, 16),), 0), (((8, 32),), 1), (((1, 40),), 1), (((1, 41),), 1)]
    assert all(r.ms > 0 for r in log) and [r.t_end for r in log] == sorted(r.t_end for r in log)


def test_the_batch_model_replays_the_engines_packing() -> None:
    """What ``batch_snapshot`` shows when an answer is planned, replayed by
    ``latency_model.step_model.batched_step_shapes``, is the engine's own steps up to that
    answer's first token: chunks in prefill order sharing a step within the step token budget,
    the first that does not fit ending the step's prefill (a later, smaller one never overtakes),
    answers ahead joining the decoders when their prefill ends and leaving at max_new. An answer
    is in the engine's queue from the moment it is planned (``stream()`` submits it), so one that
    arrives after that only rides along in room left over."""
    from latency_model.step_model import batched_step_shapes

    model = _tiny("llama")
    register_packed_attention()
    model.config._attn_implementation = ATTN_NAME
    engine = Engine(model, "cpu", threading.Lock(), lambda _ids: None, lambda *_a: None, 4, 24)

    def seq(n: int, first: int, max_new: int) -> Sequence:
        return Sequence(prompt=list(range(first, first + n)), prefix_len=0, max_new=max_new, chunk=16,
                        select=lambda _logits: 7, eos=frozenset())

    a, b, c, d = seq(40, 5, 3), seq(30, 50, 2), seq(4, 90, 2), seq(20, 100, 4)
    with engine._state:  # everything queued before the first step
        engine.submit(a)
        engine.submit(b)
        snapshot = engine.batch_snapshot()  # what d's plan sees
        engine.submit(d)  # d is planned now, and so queued ...
        engine.submit(c)  # ... then c arrives
    for s in (a, b, c, d):
        while not isinstance(s.out.get(timeout=30), Finished):
            pass
    assert snapshot == BatchSnapshot((), (Prefilling(40, 0, 3, 0), Prefilling(30, 0, 2, 1)))
    assert (d.order, c.order) == (2, 3)
    predicted = [(p.segments, p.logit_rows) for p in batched_step_shapes(
        prompt_tokens=20, cached_tokens=0, prefix_tokens=0, chunk_tokens=16,
        decode_contexts=snapshot.decoding, prefills_ahead=snapshot.prefilling, step_token_budget=24)]
    logged = [(r.segments, r.logit_rows) for r in engine.recent_steps()]
    assert predicted == [
        (((16, 0),), 0),  # b's 16 would not fit beside a's: the step's prefill ends there
        (((16, 16),), 0),  # c's 4 would have fitted, but does not overtake b and d
        (((8, 32), (16, 0)), 1),
        (((1, 40), (14, 16)), 2),
        (((1, 41), (1, 30), (16, 0)), 2),
        (((4, 16),), 1)]  # d's first token
    assert logged[:4] == predicted[:4]
    # c, submitted after d's plan, rides along in the room d's chunks leave, never before them.
    assert logged[4] == (((1, 41), (1, 30), (16, 0), (4, 0)), 3)
    assert logged[5] == (((1, 4), (4, 16)), 2)
    engine.close()
