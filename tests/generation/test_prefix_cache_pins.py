"""Pins on the prefix cache: a planned chain held against eviction until its answer is admitted
or abandoned (small fake tensors and a fake model runner, no model).

Checked: a pinned block survives eviction pressure that evicts it unpinned; pins count against
the budget (their share of it), so a pin past it reports fewer cached tokens and the bytes
held never go above the budget; every pin is released on admission, on cancel and on a failed
admission (the count returns to 0); the scaffold-only scope loads and stores the scaffold alone.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from generation.engine.core import Engine
from generation.engine.kv_cache import BlockPrefixCache, KVCache
from generation.engine.messages import Admitted, EngineEvent, Finished
from generation.engine.request import Request
from generation.engine.scheduler import StepPlan
from tests.generation.test_prefix_cache import TOKEN_BYTES, fake_kv, fill

BLOCK = 4 * TOKEN_BYTES  # one 4-token block of the fake K/V
SCAFFOLD = [1, 2, 3, 4]


def cache(blocks: float, pin_share: float = 1.0, scope: str = "all") -> BlockPrefixCache:
    return BlockPrefixCache("m@sha256:w", "cpu", "float32", chunk=4, budget_mib=blocks * BLOCK / (1 << 20),
                            pin_share=pin_share, scope=scope)


def page(i: int) -> list[int]:
    return [100 + 4 * i + j for j in range(4)]


def test_a_pinned_block_survives_pressure_that_evicts_it_unpinned() -> None:
    for pinned in (False, True):
        c = cache(5)
        a = SCAFFOLD + page(0) + page(1) + [9]
        keys = fill(c, a, 4)  # scaffold, a1, a2
        pin = c.pin(a, 4) if pinned else None
        for i in range(5, 10):  # five other one-block pages after the same scaffold: a1, a2 are LRU
            plan = c.plan(SCAFFOLD + page(i), 4, 4)
            assert c.insert(plan.keys[1], plan.keys[0], 4, fake_kv(4, 4), None)
        held = set(c.lru_keys())
        if pinned:
            assert pin is not None and pin.cached_tokens == 12
            assert set(keys) <= held  # the pinned chain is all there
            assert c.cached_tokens(a, 4) == 12
        else:
            assert not set(keys[1:]) <= held  # without the pin its blocks went first
        assert c.bytes_used <= c.budget_bytes and c.stats().peak_bytes <= c.budget_bytes
        if pin is not None:
            pin.release()
        assert c.pins_held() == 0 and c.stats().pinned_bytes == 0


def test_a_store_that_finds_only_pinned_blocks_is_not_kept() -> None:
    c = cache(3)
    a = SCAFFOLD + page(0) + page(1) + [9]
    fill(c, a, 4)
    pin = c.pin(a, 4)
    plan = c.plan(SCAFFOLD + page(3), 4, 4)
    assert not c.insert(plan.keys[1], plan.keys[0], 4, fake_kv(4, 4), None)  # no room: all pinned
    assert c.bytes_used == 3 * BLOCK == c.budget_bytes and c.stats().refused == 1
    pin.release()
    assert c.insert(plan.keys[1], plan.keys[0], 4, fake_kv(4, 4), None)  # now the LRU leaf goes
    assert c.bytes_used <= c.budget_bytes


def test_pins_past_their_share_of_the_budget_report_fewer_cached_tokens() -> None:
    c = cache(8, pin_share=0.5)  # pins may hold 4 blocks
    a = SCAFFOLD + page(0) + page(1) + page(2) + [9]
    b = SCAFFOLD + page(4) + page(5) + page(6) + [9]
    fill(c, a, 4)
    fill(c, b, 4)
    first = c.pin(a, 4)
    assert first.cached_tokens == 16 == c.cached_tokens(a, 4)  # 4 blocks: the share is full
    second = c.pin(b, 4)  # its scaffold is pinned already; b1.. would pass the share
    assert second.cached_tokens == 4 < c.cached_tokens(b, 4) == 16
    assert c.stats().pin_shortened == 1 and c.stats().pinned_bytes <= c.pin_limit_bytes
    first.release()
    second.release()
    again = c.pin(b, 4)
    assert again.cached_tokens == 16
    again.release()
    assert c.pins_held() == 0 and c.stats().pinned_blocks == 0


def test_release_is_idempotent_and_a_pin_outlives_clear_without_holding_anything() -> None:
    c = cache(4)
    a = SCAFFOLD + page(0) + [9]
    fill(c, a, 4)
    pin = c.pin(a, 4)
    assert c.take_pin(a, 4, 4) is pin and c.take_pin(a, 4, 4) is None  # taken once
    pin.release()
    pin.release()
    assert c.pins_held() == 0 and c._blocks[pin.keys[0]].pins == 0
    other = c.pin(a, 4)
    c.clear()
    fill(c, a, 4)  # the same keys again, never pinned
    other.release()
    assert c.pins_held() == 0 and all(b.pins == 0 for b in c._blocks.values())


def test_the_scaffold_scope_loads_and_stores_the_scaffold_block_alone() -> None:
    c = cache(8, scope="scaffold")
    a = SCAFFOLD + page(0) + page(1) + [9]
    seq_plan = c.plan(a, 4, 4)
    kv = KVCache(blocks=c)
    buffer = kv.admit(a, 4, 1, 4).kv
    for layer, (k, v) in fake_kv(0, len(a)).items():
        buffer.k[layer], buffer.v[layer] = k, v
    kv.store_block(buffer, seq_plan, 2, None)
    assert c.lru_keys() == []  # a chunk block is not kept
    kv.store_block(buffer, seq_plan, 0, torch.zeros(3))
    assert c.lru_keys() == [seq_plan.keys[0]]
    c.scope = "all"
    fill(c, a, 4)
    assert c.cached_tokens(a, 4) == 12
    c.scope = "scaffold"
    assert c.cached_tokens(a, 4) == 4 and c.pin(a, 4).cached_tokens == 4


# --- the engine: taken at submit, released at admission, cancel or a failed admission ----------

class Runner:
    """The runner's API without a model: a zero logits row ``(3,)`` per logit row."""

    def run(self, plan: StepPlan, requests: Any) -> list[Any]:
        return [torch.zeros(3) for _ in range(plan.logit_rows)]


def engine_with(c: BlockPrefixCache) -> Engine:
    engine = Engine(None, "cpu", threading.Lock(), lambda _ids: None, lambda *_a: None, 4, 64,
                    prefix_cache=c)
    engine.runner = Runner()  # type: ignore[assignment]
    return engine


def request(prompt: list[int], cancel: threading.Event | None = None) -> Request:
    return Request(prompt=prompt, prefix_len=4, max_new=2, chunk=4, select=lambda _row: 7,
                   eos=frozenset(), cancel=cancel)


def events_until_end(req: Request) -> list[EngineEvent]:
    out: list[EngineEvent] = []
    while not out or not isinstance(out[-1], Finished):
        out.append(req.out.get(timeout=30))
    return out


def test_the_engine_releases_a_pin_at_admission_and_admission_loads_what_it_counted() -> None:
    c = cache(16)
    a = SCAFFOLD + page(0) + page(1) + [9]
    fill(c, a, 4)
    engine = engine_with(c)
    try:
        pin = engine.pin(a, 4, 4)
        assert pin is not None and pin.cached_tokens == 12 and c.pins_held() == 1
        req = request(a)
        engine.submit(req)
        events = events_until_end(req)
    finally:
        engine.close()
    admitted = next(e for e in events if isinstance(e, Admitted))
    assert admitted.cached_tokens == pin.cached_tokens and events[-1] == Finished("length")
    assert not pin.held and c.pins_held() == 0 and c.stats().pinned_bytes == 0


def test_a_pinned_answer_cancelled_before_admission_leaves_no_pin() -> None:
    c = cache(16)
    a = SCAFFOLD + page(0) + [9]
    fill(c, a, 4)
    engine = engine_with(c)
    cancel = threading.Event()
    cancel.set()  # the client left while the answer waited
    try:
        pin = engine.pin(a, 4, 4)
        assert pin is not None and c.pins_held() == 1
        req = request(a, cancel)
        engine.submit(req)
        assert events_until_end(req)[-1] == Finished("cancelled")
    finally:
        engine.close()
    assert c.pins_held() == 0 and all(b.pins == 0 for b in c._blocks.values())
    # an answer that never reached the engine: its caller releases the pin it still holds
    never = c.pin(a, 4)
    assert c.pins_held() == 1
    never.release()
    assert c.pins_held() == 0


def test_a_failed_admission_releases_its_pin() -> None:
    c = cache(16)
    a = SCAFFOLD + page(0) + [9]
    fill(c, a, 4)
    engine = engine_with(c)

    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("no memory for the buffer")

    engine.kv_cache.admit = broken  # type: ignore[method-assign]
    try:
        engine.pin(a, 4, 4)
        req = request(a)
        engine.submit(req)
        end = events_until_end(req)[-1]
    finally:
        engine.close()
    assert isinstance(end, Finished) and end.reason == "error"
    assert c.pins_held() == 0


def test_run_alone_on_a_prompt_cached_whole_stops_at_its_first_token() -> None:
    """A prompt whose chain covers it whole (with the logits after it) takes its first token
    from the cache; run_alone stops there, so a timed decode step after it still has one to do
    (the decode timer of calibration used to find the answer already ended)."""
    c = cache(16)
    a = SCAFFOLD + page(0)  # ends on a block boundary: cached whole with its logits
    fill(c, a, 4, logits=torch.zeros(3))
    engine = engine_with(c)
    req = Request(prompt=a, prefix_len=4, max_new=2, chunk=4, select=lambda _row: 7, eos=frozenset())
    engine.run_alone(req)
    assert req.cached_tokens == len(a) and req.produced == 1 and not req.done
    assert engine.steps == 0  # no forward: the first token came from the cached logits
