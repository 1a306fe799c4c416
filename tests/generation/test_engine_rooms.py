"""The engine's rooms on a fake model runner (no model, no torch).

The engine core runs its real admission, scheduler, KV bookkeeping and token routing; only
the runner's forward is replaced by one that returns placeholder logits rows. Checked: the
steps the latency model replays from a batch snapshot
(``latency_model.step_model.batched_step_shapes``) are the steps the engine's scheduler plans
and runs, over many random queue states; and every event the engine puts on an answer's
queue is a typed message (``generation.engine.messages``), never a tuple.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from generation.engine.core import Engine
from generation.engine.kv_cache import SeqKV
from generation.engine.messages import Admitted, EngineEvent, Finished, Token
from generation.engine.request import Request
from generation.engine.scheduler import StepPlan
from latency_model.step_model import StepShape, batched_step_shapes

TOKEN = 7  # what every fake sampler picks (never an end-of-text id: eos is empty)


class FakeRow:
    """A logits row stand-in (the fake sampler ignores it; the scaffold store clones it)."""

    def clone(self) -> FakeRow:
        return self


class FakeRunner:
    """The runner's public API without a model: one placeholder row per logit row."""

    def __init__(self) -> None:
        self.plans: list[StepPlan] = []

    def run(self, plan: StepPlan, requests: Any) -> list[FakeRow]:
        self.plans.append(plan)
        return [FakeRow() for _ in range(plan.logit_rows)]


def fake_engine(max_running: int, budget: int) -> tuple[Engine, FakeRunner]:
    engine = Engine(None, "cpu", threading.Lock(), lambda _ids: None, lambda *_a: None,
                    max_running, budget)
    runner = FakeRunner()
    engine.runner = runner  # type: ignore[assignment]
    return engine, runner


def request(n: int, prefix: int, max_new: int, chunk: int) -> Request:
    return Request(prompt=list(range(10, 10 + n)), prefix_len=prefix, max_new=max_new, chunk=chunk,
                   select=lambda _logits: TOKEN, eos=frozenset())


def decoder(context: int, steps_left: int, chunk: int) -> Request:
    """An answer already decoding: ``context`` tokens in its KV, ``steps_left`` tokens to go."""
    req = request(context, 0, steps_left + 1, chunk)
    req.kv, req.pos, req.admitted_t = SeqKV(context + steps_left + 2), context, time.perf_counter()
    req.next_tok, req.produced = TOKEN, 1
    return req


def events_until_end(req: Request) -> list[EngineEvent]:
    out: list[EngineEvent] = []
    while not out or not isinstance(out[-1], Finished):
        out.append(req.out.get(timeout=30))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk=st.integers(2, 24), budget=st.integers(1, 64),
       decoders=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 6)), max_size=3),
       ahead=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6)), max_size=4),
       own=st.tuples(st.integers(1, 60), st.integers(0, 60)))
def test_the_step_model_replays_the_steps_the_engines_scheduler_plans(
        chunk: int, budget: int, decoders: list[tuple[int, int]], ahead: list[tuple[int, int]],
        own: tuple[int, int]) -> None:
    """Answers decoding and answers queued to prefill, then a new answer planned from the
    engine's snapshot: the replay of that snapshot is, step for step, what the engine ran
    (each step's segments and logit rows) until the new answer's first token. (Sizes keep
    every run within the step log's 256 steps.)"""
    n, prefix = own[0], min(own[1], own[0])
    engine, runner = fake_engine(len(decoders) + len(ahead) + 1, budget)
    reqs = [decoder(ctx, left, chunk) for ctx, left in decoders]
    reqs += [request(m, 0, max_new, chunk) for m, max_new in ahead]
    new = request(n, prefix, 4, chunk)
    try:
        with engine._state:  # the step loop waits: everything is queued before its first step
            for req in reqs:
                engine.submit(req)
            snapshot = engine.batch_snapshot()  # what the new answer's plan sees
            engine.submit(new)
        for req in [*reqs, new]:
            events_until_end(req)
    finally:
        engine.close()
    predicted = batched_step_shapes(prompt_tokens=n, cached_tokens=0, prefix_tokens=prefix,
                                    chunk_tokens=chunk, decode_contexts=snapshot.decoding,
                                    prefills_ahead=snapshot.prefilling, step_token_budget=budget)
    assert predicted, "the new answer runs at least one step"
    ran = [StepShape.of_plan(p) for p in runner.plans[:len(predicted)]]
    logged = [StepShape(r.segments, r.logit_rows) for r in engine.recent_steps()[:len(predicted)]]
    assert ran == predicted and logged == predicted
    last = runner.plans[len(predicted) - 1]
    assert any(not c.decode and c.start + c.tokens == n for c in last.chunks)  # its last chunk


def test_the_engine_emits_typed_events_only_admitted_tokens_then_the_end() -> None:
    """Each answer's queue holds Admitted, then a Token per token, then Finished: frozen
    dataclasses, never tuples; a cancelled answer ends with Finished("cancelled")."""
    engine, _runner = fake_engine(4, 32)
    answers = [request(20, 8, 3, 8), request(5, 0, 2, 8)]
    leaving = request(30, 0, 10**9, 4)  # ends only when cancelled
    leaving.cancel = threading.Event()
    try:
        with engine._state:
            for req in [*answers, leaving]:
                engine.submit(req)
        runs = [events_until_end(req) for req in answers]
        leaving.cancel.set()
        engine.wake()
        gone = events_until_end(leaving)
    finally:
        engine.close()
    for events, req in zip(runs, answers, strict=True):
        assert isinstance(events[0], Admitted) and events[0].cached_tokens == 0
        assert [type(e) for e in events[1:-1]] == [Token] * req.max_new
        assert all(e.token_id == TOKEN for e in events[1:-1] if isinstance(e, Token))
        assert events[-1] == Finished("length")
    assert gone[-1] == Finished("cancelled")
    for event in [*runs[0], *runs[1], *gone]:
        assert not isinstance(event, tuple) and dataclasses.is_dataclass(event)
        try:
            event.reason = "changed"
        except dataclasses.FrozenInstanceError:
            pass
        else:
            raise AssertionError(f"{event!r} is not frozen")
