"""The planner knows before it chooses: each candidate prompt's tokens held by the engine's prefix
cache are priced as cached, so a larger k fits the same budget when chunks are warm; the answer,
its receipt and the advice show cached vs computed tokens per k.

The pipeline runs for real over fake model services (tests/api/fakes.py); the generator's engine
is a stand-in for the local engine's block cache (:class:`FakeBlockCache`), so no model loads.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from app.answering.kv_lookup import cached_per_k
from app.answering.pipeline import AnswerPipeline
from app.answering.state import AnswerRequest
from app.services import Services
from latency_model.calibration import calibrate
from latency_model.grid import quick_grid
from latency_model.profile import Profile
from receipts.chain import get_receipt
from tests.api.conftest import api_settings, services_with_docs
from tests.api.fakes import CharTokenizer, EchoGenerator
from tests.latency_model.conftest import FakeTimer, no_cpu_probe

CHUNK = 16
DOCS = {f"station-{i}.txt": f"Station {i}: the circulation pump {i} is painted colour number {i}; "
        f"its relief valve is inspected every {i + 2} weeks by the engineer on duty." for i in range(4)}
QUESTION = "What colour is the circulation pump painted?"


class FakePin:
    """A pin handle: the prompt it holds, its cached tokens, how often it was released."""

    def __init__(self, prompt: list[int], cached_tokens: int) -> None:
        self.prompt, self.cached_tokens, self.releases = prompt, cached_tokens, 0

    def release(self) -> None:
        self.releases += 1


class FakeBlockCache:
    """The local engine's :meth:`generation.engine.core.Engine.cached_tokens` over a set of warm
    prompts: the longest common prefix with one of them, cut to the chunk grid (the scaffold's
    chunks from 0, the rest from the scaffold's end); a whole prompt only when it is warm itself."""

    def __init__(self) -> None:
        self.warm: list[list[int]] = []
        self.pins: list[FakePin] = []

    def pin(self, prompt: list[int], prefix_len: int, chunk: int) -> FakePin:
        """The local engine's :meth:`generation.engine.core.Engine.pin`: a handle on the prompt."""
        self.pins.append(FakePin(list(prompt), self.cached_tokens(prompt, prefix_len, chunk)))
        return self.pins[-1]

    def cached_tokens(self, prompt: list[int], prefix_len: int, chunk: int) -> int:
        best = 0
        for w in self.warm:
            if w == prompt:
                return len(prompt)
            n = next((i for i, (a, b) in enumerate(zip(w, prompt, strict=False)) if a != b),
                     min(len(w), len(prompt)))
            n = min(n, len(prompt) - 1)  # the last token is always computed (its logits)
            grid = (n // chunk) * chunk if n < prefix_len else prefix_len + (n - prefix_len) // chunk * chunk
            best = max(best, grid)
        return best


class CachingGenerator(EchoGenerator):
    """:class:`EchoGenerator` with a block-cache engine and the local engine's prefill chunk."""

    prefill_chunk = CHUNK

    def __init__(self, tokenizer: CharTokenizer) -> None:
        super().__init__(tokenizer, reply="painted")
        self.engine = FakeBlockCache()


@pytest.fixture(scope="module")
def profile() -> Profile:
    return calibrate(FakeTimer(), grid=quick_grid(8192, [200]), seed=3, progress=False,
                     cpu_probe=no_cpu_probe)


def services_with(root: Path, profile: Profile, gen: Any) -> Services:
    settings = api_settings(root, auth_enabled=False, default_max_new_tokens=4, retrieval_candidates=4,
                            online_correction=False)
    return services_with_docs(settings, profile, gen, DOCS)


@pytest.fixture
def world(tmp_path: Path, profile: Profile) -> Any:
    gen = CachingGenerator(CharTokenizer())
    services = services_with(tmp_path, profile, gen)
    yield AnswerPipeline(services), gen
    services.close()


def _budget_between(rows: list[Any], k: int) -> float:
    """A budget that row ``k`` fits at p95 and row ``k + 1`` does not (no overhead)."""
    return (rows[k].ttft_p95_ms + rows[k + 1].ttft_p95_ms) / 2.0


def test_each_candidate_prompt_is_looked_up_with_its_own_ids(world: Any) -> None:
    pipe, gen = world
    full = pipe.prepare(AnswerRequest(question=QUESTION, ttft_budget_ms=60_000)).full_prompt
    k_max = len(full.chunk_token_counts)
    assert k_max >= 3
    builder = pipe.scaffold_and_builder()[1]
    chunks = pipe.prompt_chunks(pipe.services.retriever.retrieve(QUESTION, 4).hits)
    for k in range(k_max + 1):  # ids_for(k) is the prompt the pipeline lays out with k chunks
        assert full.ids_for(k) == pipe.laid_out(builder, pipe.scaffold_and_builder()[0].text, chunks[:k],
                                                QUESTION, []).ids
    assert cached_per_k(gen, full) == (0,) * (k_max + 1)
    gen.engine.warm.append(full.ids_for(k_max))
    cached = cached_per_k(gen, full)
    assert cached is not None and cached[-1] == full.prompt_tokens_for(k_max)
    assert all(full.scaffold_len < c < full.prompt_tokens_for(k) for k, c in enumerate(cached[1:-1], 1))


def test_the_planner_picks_a_larger_k_when_the_chunks_are_warm(world: Any) -> None:
    pipe, gen = world
    p = pipe.prepare(AnswerRequest(question=QUESTION, ttft_budget_ms=60_000))
    cold_rows = pipe.bind(p, now_t=p.arrival_t).plan.rows
    budget = _budget_between(cold_rows, 1)
    cold = pipe.bind(replace(p, budget_ms=budget), now_t=p.arrival_t).plan
    assert cold.chosen_k == 1 and cold.binding == "budget"
    # an earlier answer prefilled the prompt with every candidate: its blocks are in the cache
    gen.engine.warm.append(p.full_prompt.ids_for(len(cold.rows) - 1))
    warm = pipe.bind(replace(p, budget_ms=budget), now_t=p.arrival_t).plan
    assert warm.chosen_k is not None and warm.chosen_k > cold.chosen_k
    for c_row, w_row in zip(cold.rows, warm.rows, strict=True):
        assert w_row.prompt_tokens == c_row.prompt_tokens
        assert w_row.cached_tokens + w_row.computed_tokens == w_row.prompt_tokens
        assert w_row.ttft_p95_ms <= c_row.ttft_p95_ms
    assert warm.rows[2].cached_tokens > p.full_prompt.scaffold_len


def test_advice_answer_and_receipt_show_cached_and_computed_tokens_per_k(world: Any) -> None:
    pipe, gen = world
    req = AnswerRequest(question=QUESTION, ttft_budget_ms=60_000)
    full = pipe.prepare(req).full_prompt
    gen.engine.warm.append(full.ids_for(2))
    expected = cached_per_k(gen, full)
    assert expected is not None and expected[2] > full.scaffold_len
    advice = pipe.advise(req)
    assert tuple(r.cached_tokens for r in advice.plan.rows) == expected
    assert all(r.computed_tokens == r.prompt_tokens - r.cached_tokens for r in advice.plan.rows)
    answer = pipe.answer(req)
    assert answer.status == "ok" and answer.receipt_id is not None
    assert tuple(answer.predicted.cached_tokens_per_k or ()) == expected
    assert answer.predicted.computed_tokens_per_k == [
        full.prompt_tokens_for(k) - c for k, c in enumerate(expected)]
    rows = get_receipt(pipe.services.engine, answer.receipt_id)["plan"]["rows"]
    assert tuple(r["cached_tokens"] for r in rows) == expected
    assert [r["computed_tokens"] for r in rows] == answer.predicted.computed_tokens_per_k


def test_an_engine_that_cannot_say_counts_the_scaffold_alone(world: Any) -> None:
    pipe, _gen = world
    plain = EchoGenerator(CharTokenizer())
    full = pipe.prepare(AnswerRequest(question=QUESTION, ttft_budget_ms=60_000)).full_prompt
    assert cached_per_k(plain, full) is None


@pytest.mark.parametrize("layout", ["canonical", "rank"])
def test_a_receipt_records_the_layout_and_replay_rebuilds_its_tokens(world: Any, layout: str) -> None:
    from app.answering.receipt_wiring import replay_receipt

    pipe, _gen = world
    pipe.prompt_layout = layout
    req = AnswerRequest(question=QUESTION, ttft_budget_ms=60_000)
    p = pipe.prepare(req)
    answer = pipe.answer(req)
    assert answer.status == "ok" and answer.receipt_id is not None and answer.chosen_k >= 3
    body = get_receipt(pipe.services.engine, answer.receipt_id)
    order = body["prompt"]["layout"]["slots"]
    assert body["prompt"]["layout"]["name"] == layout and sorted(order) == list(range(1, answer.chosen_k + 1))
    chunks = pipe.prompt_chunks(p.retrieval.hits)[:answer.chosen_k]
    if layout == "canonical":  # documents in id order: station-0 first whatever its rank
        shown = [chunks[n - 1] for n in order]
        assert [str(c.document_id) for c in shown] == sorted(str(c.document_id) for c in chunks)
        assert order != list(range(1, answer.chosen_k + 1)), "the ranking should not be document order"
    else:
        assert order == list(range(1, answer.chosen_k + 1))
    # each citation names the number the prompt showed it under
    assert {c.slot: c.shown_as for c in answer.citations} == {n: i for i, n in enumerate(order, 1)}
    report = replay_receipt(pipe.services, answer.receipt_id)
    assert report.check("prompt").status == "ok", report.render()


def test_the_chosen_prompt_is_pinned_when_it_gets_the_model_and_released_when_it_ends(world: Any) -> None:
    pipe, gen = world
    req = AnswerRequest(question=QUESTION, ttft_budget_ms=60_000)
    full = pipe.prepare(req).full_prompt
    gen.engine.warm.append(full.ids_for(2))
    answer = pipe.answer(req)
    assert answer.status == "ok"
    (pin,) = gen.engine.pins  # one pin, on the prompt the answer ran
    assert pin.prompt == full.ids_for(answer.chosen_k) and pin.cached_tokens > full.scaffold_len
    assert pin.releases >= 1  # the engine here never admits it: the pipeline releases it
    cancel = threading.Event()
    cancel.set()
    for _ in pipe.stream(req, cancel=cancel):  # a request that leaves: its pin goes too
        pass
    assert all(p.releases >= 1 for p in gen.engine.pins)
