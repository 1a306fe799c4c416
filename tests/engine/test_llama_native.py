"""llama.cpp's native server (``llama-server --parallel N``) behind the remote backend.

The server runs several requests at once, one per slot; ragbudget reads the slot
count from ``GET /props`` and lets that many answers through its queue, instead
of driving the engine one request at a time. Its streams report the prompt
tokens its slot cache held (``timings.cache_n``), recorded as cached tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from generation.base import GenParams
from tests.engine.conftest import ALIAS, DOCS, run_cli

pytestmark = [pytest.mark.engine, pytest.mark.slow]
SLOTS = 2
N_CTX = 4096 * SLOTS  # the server splits its context over the slots


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory, llama_server_native_binary: Path) -> Iterator[Any]:
    """The packaged SmolLM2 GGUF on llama.cpp's native server with two slots, 2 threads."""
    from generation.assets import packaged_gguf_path
    from ragbudget_testing.llama_server import NativeLlamaServer

    binary = llama_server_native_binary
    log = tmp_path_factory.mktemp("llama-native") / "server.log"
    with NativeLlamaServer(packaged_gguf_path(), log, alias=ALIAS, n_ctx=N_CTX, threads=2,
                           parallel=SLOTS, binary=binary) as server:
        yield server


def _generator(native: Any, smollm_dir: Path, **kwargs: Any) -> Any:
    from generation.assets import load_tokenizer
    from generation.remote import RemoteGenerator
    from retrieval.tokens import HFTextTokenizer

    tok = HFTextTokenizer(load_tokenizer(smollm_dir), name=str(smollm_dir))
    return RemoteGenerator(native.base_url, ALIAS, tokenizer=tok, context_window=N_CTX // SLOTS,
                           **kwargs)


def test_the_engine_says_how_many_requests_it_runs_at_once(native: Any, smollm_dir: Path) -> None:
    assert len(native.slots()) == SLOTS
    assert _generator(native, smollm_dir).max_running == SLOTS  # from GET /props total_slots
    assert _generator(native, smollm_dir, max_running=1).max_running == 1  # the setting wins


def test_prompts_go_as_token_ids_and_the_slot_cache_is_counted(native: Any, smollm_dir: Path) -> None:
    gen = _generator(native, smollm_dir)
    words = " ".join(f"gauge{i} reads {i * 7} kPa;" for i in range(60))
    shared = gen.tokenizer.encode(f"Pressure log. {words}")
    runs = []
    for question in ("Which gauge reads 70 kPa?", "Which gauge reads 140 kPa?"):
        ids = shared + gen.tokenizer.encode(f"\nQuestion: {question}\nAnswer:")
        answer = gen.stream(ids, params=GenParams(max_new_tokens=6))
        text = "".join(e.text for e in answer)
        stats = answer.stats
        assert text and stats.finish_reason in ("stop", "length")
        assert stats.cached_tokens + stats.computed_tokens == len(ids)
        runs.append(stats)
    assert gen.identity["mode"] == "completions"  # the native server reads token ids
    # The second prompt shares the first's long prefix: the slot that served the first
    # (llama.cpp routes a prompt to the slot with the longest common prefix) reuses it.
    assert runs[1].cached_tokens >= len(shared) - 1 > runs[0].cached_tokens


def test_a_second_answer_runs_beside_the_first_instead_of_queueing(
        native: Any, smollm_dir: Path, tmp_path: Path) -> None:
    """With no waiting allowed (``queue_max=0``), a second answer is admitted only if the
    engine's second slot is given to it while the first answer is still streaming."""
    from app.answering.pipeline import AnswerPipeline
    from app.answering.state import AnswerRequest
    from app.profile_store import generator_config, save_profile
    from app.services import Services
    from app.settings import Settings
    from foundation.errors import RagBudgetError
    from latency_model.roofline import build_prior

    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    remote = {"RAGBUDGET_GENERATOR_BACKEND": "remote", "RAGBUDGET_REMOTE_BASE_URL": native.base_url,
              "RAGBUDGET_REMOTE_MODEL": ALIAS, "RAGBUDGET_REMOTE_TOKENIZER": str(smollm_dir),
              "RAGBUDGET_REMOTE_CONTEXT_WINDOW": str(N_CTX // SLOTS)}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGBUDGET_")}
    env.update(remote, RAGBUDGET_DATA_DIR=str(tmp_path / "data"), RAGBUDGET_TORCH_THREADS="1")
    run_cli(env, "ingest", str(docs))

    def settings_for(max_running: int | None) -> Settings:
        return Settings(data_dir=tmp_path / "data", generator_backend="remote",
                            remote_base_url=native.base_url, remote_model=ALIAS,
                            remote_tokenizer=str(smollm_dir), remote_context_window=N_CTX // SLOTS,
                            remote_max_running=max_running, queue_max=0, torch_threads=1)

    # This test is about admission, not the budget: a roofline prior stands in for a fitted
    # profile (calibrating through HTTP takes minutes; test_llama_cpp.py does that).
    services = Services(settings_for(None))
    gen = services.generator
    save_profile(services.engine, services.data_dir,
                 build_prior({**gen.identity, "weights_hash": "", "dtype": ""},  # as key_of reads them
                             generator_config(gen), peak_flops=5e10,
                             bandwidth_bytes_s=1e10, peaks_source="a stand-in for this test",
                             created_at="2026-12-04T00:00:00Z"))

    def answers(max_running: int | None) -> tuple[str, str]:
        pipeline = AnswerPipeline(Services(settings_for(max_running)))
        first = pipeline.stream(AnswerRequest("When are check valves tested?", ttft_budget_ms=60000,
                                              max_new_tokens=24))
        event = next(first)
        while event.kind != "token":  # the first answer holds its slot from here on
            event = next(first)
        try:
            second = pipeline.answer(AnswerRequest("How often are sand filters backwashed?",
                                                   ttft_budget_ms=60000, max_new_tokens=4))
            outcome = second.status
        except RagBudgetError as exc:
            outcome = str(getattr(exc, "code", type(exc).__name__))
        finals = [e for e in first if e.kind in ("final", "error")]
        summary = finals[-1].summary
        assert summary is not None
        return outcome, summary.status

    assert answers(None) == ("ok", "ok")  # two slots from /props: both run
    refused, first_status = answers(1)  # the setting holds it to one: the second is refused
    assert refused != "ok" and first_status == "ok"


def test_the_cached_tokens_the_engine_reports_are_learned_and_predicted(native: Any,
                                                                        smollm_dir: Path) -> None:
    """The planner's cached-token figure for a remote engine follows what its server reports
    (``timings.cache_n``): a repeated long prefix is predicted cached past the scaffold once
    four answers were learned."""
    gen = _generator(native, smollm_dir)
    words = " ".join(f"valve{i} opens at {i * 3} bar;" for i in range(40))
    scaffold = gen.tokenizer.encode("Valve table. ")
    shared = scaffold + gen.tokenizer.encode(words)
    assert gen.cached_tokens(shared, len(scaffold), 1) == 0  # nothing sent yet
    reports = []
    for i in range(5):
        ids = shared + gen.tokenizer.encode(f"\nQuestion: which valve opens at {3 * i} bar?\nAnswer:")
        answer = gen.stream(ids, params=GenParams(max_new_tokens=2))
        list(answer)
        reports.append((answer.stats.cache_reported, answer.stats.cached_tokens))
    assert all(flag for flag, _ in reports), reports
    ratio = gen.prefix_memory.hit_ratio()
    assert ratio is not None and ratio > 0.5, (gen.prefix_memory.status(), reports)
    probe = shared + gen.tokenizer.encode("\nQuestion: which valve opens at 60 bar?\nAnswer:")
    predicted = gen.cached_tokens(probe, len(scaffold), 1)
    assert len(scaffold) < predicted <= len(probe)
    answer = gen.stream(probe, params=GenParams(max_new_tokens=2))
    list(answer)
    # the prediction is within the slot cache's reuse of the shared prefix, one token either way
    assert abs(answer.stats.cached_tokens - predicted) <= max(2, len(shared) // 10), (
        predicted, answer.stats.cached_tokens)
