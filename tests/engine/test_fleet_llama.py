"""Two real llama.cpp servers as a fleet (``RAGBUDGET_ENGINES``): routing, per-engine profiles,
load from a client that bypasses ragbudget, an engine killed and brought back, an engine that
accepts an answer and sends no first token (stopped with SIGSTOP) taken out and brought back.

Each server is llama.cpp's native ``llama-server`` with one slot, one thread, pinned to its own
core, serving the packaged SmolLM2 GGUF. Each engine's profile is fitted on that engine over a
small grid (real timed requests), so the planner prices each engine by its own measurements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import ALIAS, DOCS

pytestmark = [pytest.mark.engine, pytest.mark.slow]
N_CTX = 2048
BUDGET_MS = 30_000.0
QUESTION = "When is the circulation pump inspected?"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory,
            llama_server_native_binary: Path) -> Iterator[dict[str, Any]]:
    """Engines ``a`` and ``b``: one llama-server each, 1 slot, 1 thread, pinned to cores 0 and 1."""
    from generation.assets import packaged_gguf_path
    from ragbudget_testing.llama_server import NativeLlamaServer

    binary = llama_server_native_binary
    root = tmp_path_factory.mktemp("fleet-llama")
    cores = sorted(os.sched_getaffinity(0))
    out: dict[str, Any] = {}
    try:
        for i, name in enumerate(("a", "b")):
            out[name] = NativeLlamaServer(packaged_gguf_path(), root / f"{name}.log", alias=ALIAS,
                                          n_ctx=N_CTX, threads=1, parallel=1, binary=binary,
                                          cpus=[cores[i % len(cores)]]).start()
        yield out
    finally:
        for server in out.values():
            server.stop()


@pytest.fixture(scope="module")
def fleet(servers: dict[str, Any], smollm_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Services over both engines, the small corpus ingested, each engine's profile fitted on it."""
    from app.answering.pipeline import AnswerPipeline
    from app.profile_store import save_profile
    from app.services import Services
    from app.settings import get_settings
    from latency_model.calibration import calibrate
    from latency_model.grid import quick_grid
    from retrieval.chunking import ChunkerConfig
    from retrieval.store import IngestItem, ingest_batch

    root = tmp_path_factory.mktemp("fleet-data")
    engines = [{"id": name, "kind": "remote", "base_url": s.base_url, "model": ALIAS,
                "tokenizer": str(smollm_dir), "context_window": N_CTX} for name, s in servers.items()]
    settings = get_settings(data_dir=root / "data", database_url=f"sqlite:///{root / 'fleet.db'}",
                            auth_enabled=False, engines=engines, torch_threads=1, retrieval_candidates=4,
                            engine_probe_interval_s=0.5, default_max_new_tokens=8)
    services = Services(settings)
    ingest_batch(services.engine, [IngestItem(document_id=k, text=v) for k, v in DOCS.items()],
                 tokenizer=services.tokenizer,
                 chunker_config=ChunkerConfig(settings.chunk_tokens, settings.chunk_overlap_tokens),
                 embedder=services.embedder)
    # a small grid: a few dozen real requests per engine
    grid = dataclasses.replace(quick_grid(N_CTX, [0]), prompt_tokens=(16, 64, 128, 256, 512, 768), repeats=1,
                               short_repeats=1, long_repeats=1, warmup=1, fresh_points=4,
                               decode_contexts=(16, 256, 512, 1024), decode_repeats=2)
    fitted = {}
    for name in servers:
        profile = calibrate(services.engine_generator(name), grid=grid, seed=0, progress=False)
        save_profile(services.engine, services.data_dir, profile)
        fitted[name] = profile
    pipe = AnswerPipeline(services)
    yield pipe, fitted
    services.close()


def _answer(pipe: Any, question: str = QUESTION, **kw: Any) -> Any:
    from app.answering.state import AnswerRequest

    return pipe.answer(AnswerRequest(question, ttft_budget_ms=BUDGET_MS, max_new_tokens=8, **kw))


def _flood(server: Any, stop: threading.Event) -> list[threading.Thread]:
    """Another client, bypassing ragbudget, keeping ``server``'s one slot busy and one request
    queued behind it (:func:`ragbudget_testing.llama_server.flood`)."""
    from ragbudget_testing.llama_server import flood

    return flood(server.base_url, stop, model=ALIAS, max_tokens=200)


def _wait_for(cond: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_answers_spread_over_both_engines_each_on_its_own_profile_and_foreign_load_moves_them(
        fleet: Any, servers: dict[str, Any]) -> None:
    from receipts.chain import get_receipt_row, parse_body
    from receipts.verify import verify_chain

    pipe, fitted = fleet
    assert fitted["a"].id != fitted["b"].id
    for name in ("a", "b"):
        assert pipe.engines[name].profile().id == fitted[name].id  # keyed by the engine's URL
        assert pipe.engines[name].sync_slots().slots == 1  # from the server's /props

    # four answers arriving 0.15 s apart over two one-slot engines: the second engine takes what
    # the first's queue would make wait
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(_answer(pipe))) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.15)
    for t in threads:
        t.join(300)
    assert len(results) == 4 and all(r.status == "ok" and r.text for r in results)
    used = {r.predicted.engine_id for r in results}
    assert used == {"a", "b"}
    for r in results:
        body = parse_body(get_receipt_row(pipe.services.engine, r.receipt_id).body)
        assert body["generator"]["engine_id"] == r.predicted.engine_id
        assert body["plan"]["profile_id"] == fitted[r.predicted.engine_id].id
        assert {p["engine_id"] for p in body["plan"]["fleet"]["predictions"]} == {"a", "b"}

    # another client floods engine a directly: its /slots shows the busy slot and its /metrics
    # the request queued behind it (llamacpp:requests_deferred), both priced as wait
    stop = threading.Event()
    flood = _flood(servers["a"], stop)
    try:
        a = pipe.engines["a"]
        assert a.load is not None
        assert _wait_for(lambda: (r := a.load.reading()) is not None and len(r.busy) == 1
                         and r.waiting == 1)
        assert a.load.supported and a.load.metrics_supported
        assert a.predicted_wait_ms() > 0.0
        got = [_answer(pipe) for _ in range(3)]
        assert [(g.status, g.predicted.engine_id) for g in got] == [("ok", "b")] * 3, [
            (g.status, g.error, g.predicted) for g in got]
    finally:
        stop.set()
        for t in flood:
            t.join(120)
    assert verify_chain(pipe.services.engine).ok


def test_an_engine_killed_is_taken_out_its_answer_retried_elsewhere_and_it_rejoins_after_restart(
        fleet: Any, servers: dict[str, Any]) -> None:
    from receipts.chain import get_receipt_row, parse_body
    from receipts.verify import verify_chain

    pipe, _fitted = fleet
    a, b = pipe.engines["a"], pipe.engines["b"]
    # engine b busy with another client's work, so engine a is the one chosen ...
    stop = threading.Event()
    flood = _flood(servers["b"], stop)
    try:
        assert _wait_for(lambda: (r := b.load.reading()) is not None and len(r.busy) == 1)
        servers["a"].stop()  # ... and then killed: connections refused
        got = _answer(pipe)
        assert got.status == "ok" and got.text and got.predicted.engine_id == "b"
        body = parse_body(get_receipt_row(pipe.services.engine, got.receipt_id).body)
        assert body["plan"]["fleet"]["retried_from"] == "a"
        assert not a.healthy and a.health.reason
        # while it is away, answers go to b
        assert _answer(pipe).predicted.engine_id == "b"
    finally:
        stop.set()
        for t in flood:
            t.join(120)
    servers["a"].start()  # same port: the background probe finds it
    assert _wait_for(lambda: a.healthy, 60.0)
    assert verify_chain(pipe.services.engine).ok


@contextlib.contextmanager
def _stalled(server: Any) -> Iterator[None]:
    """``server`` stopped (SIGSTOP: it accepts connections and answers nothing) inside the block,
    continued (SIGCONT) on every way out."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def _busy_b_stalled_a(pipe: Any, servers: dict[str, Any], stop: threading.Event,
                      max_tokens: int) -> list[threading.Thread]:
    """Engine b flooded by another client (so the planner chooses a), both engines in rotation."""
    from ragbudget_testing.llama_server import flood

    assert _wait_for(lambda: pipe.engines["a"].healthy and pipe.engines["b"].healthy, 60.0)
    threads = flood(servers["b"].base_url, stop, model=ALIAS, max_tokens=max_tokens)
    b = pipe.engines["b"]
    assert _wait_for(lambda: b.load is not None and (r := b.load.reading()) is not None and len(r.busy) == 1)
    return threads


def test_an_engine_that_sends_no_first_token_in_time_is_taken_out_the_answer_retried_and_it_rejoins(
        fleet: Any, servers: dict[str, Any]) -> None:
    from receipts.chain import get_receipt_row, parse_body
    from receipts.verify import verify_chain

    pipe, _fitted = fleet
    a = pipe.engines["a"]
    before = verify_chain(pipe.services.engine).checked
    stop = threading.Event()
    flood = _busy_b_stalled_a(pipe, servers, stop, max_tokens=48)
    result: dict[str, Any] = {}
    try:
        with _stalled(servers["a"]):
            t0 = time.perf_counter()
            # a question neither engine has served: its prompt is cached on neither, so the
            # choice follows the flood on b, not the prefix cache b learned earlier
            asker = threading.Thread(target=lambda: result.update(
                got=_answer(pipe, "What does the low-level switch on the tank do?")))
            asker.start()
            # a holds the answer (sent, no first token coming): the flood on b stops, so the
            # retry gets b's slot once the flood's last requests end
            assert _wait_for(lambda: a.in_flight() >= 1 or not a.healthy, 30.0)
            stop.set()
            asker.join(180)
            took_s = time.perf_counter() - t0
            assert not asker.is_alive(), "the answer hangs on the stopped engine"
            got = result["got"]
            assert got.status == "ok" and got.text and got.predicted.engine_id == "b", (got.status, got.error)
            body = parse_body(get_receipt_row(pipe.services.engine, got.receipt_id).body)
            assert body["plan"]["fleet"]["retried_from"] == "a"
            assert "first token" in body["plan"]["fleet"]["retry_reason"]
            assert not a.healthy and "first token" in (a.health.reason or "")
            # still stopped: the probe gets no answer, a stays out
            time.sleep(1.5)
            assert not a.healthy
    finally:
        stop.set()
        for t in flood:
            t.join(120)
    assert took_s < 120.0  # the stall cost the deadline, not the 120 s read timeout
    assert _wait_for(lambda: a.healthy, 60.0)  # continued: the background probe brings it back
    report = verify_chain(pipe.services.engine)
    assert report.ok and report.checked == before + 1


def test_a_stalled_answer_that_must_make_its_budget_ends_with_first_token_timeout_and_its_receipt(
        fleet: Any, servers: dict[str, Any]) -> None:
    from app.answering.state import AnswerRequest
    from receipts.chain import get_receipt_row, parse_body
    from receipts.verify import verify_chain

    pipe, _fitted = fleet
    a = pipe.engines["a"]
    before, downs = verify_chain(pipe.services.engine).checked, a.health.downs
    budget_ms = 1500.0
    stop = threading.Event()
    flood = _busy_b_stalled_a(pipe, servers, stop, max_tokens=200)
    try:
        with _stalled(servers["a"]):
            t0 = time.perf_counter()
            got = pipe.answer(AnswerRequest("Who may reset the high-pressure alarm?",  # cached nowhere
                                            ttft_budget_ms=budget_ms, max_new_tokens=8,
                                            on_budget_miss="reject"))
            took_ms = (time.perf_counter() - t0) * 1000.0
    finally:
        stop.set()
        for t in flood:
            t.join(120)
    assert got.status == "failed" and got.error is not None
    assert got.error.code == "first_token_timeout" and got.predicted.engine_id == "a"
    assert took_ms < budget_ms + 1000.0  # ended at the budget, not left hanging
    assert got.receipt_status == "written"
    body = parse_body(get_receipt_row(pipe.services.engine, got.receipt_id).body)
    assert body["status"] == "failed" and body["generator"]["engine_id"] == "a"
    assert a.health.downs == downs + 1  # taken out (and probed back once continued)
    assert _wait_for(lambda: a.healthy, 60.0)
    report = verify_chain(pipe.services.engine)
    assert report.ok and report.checked == before + 1  # one receipt, not two
