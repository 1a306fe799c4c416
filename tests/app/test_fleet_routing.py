"""Engines as a fleet in the answer path: configuration, joint choice of engine and k, receipts,
replay on the recorded engine, rotation (unit level: fake generators, real planner, real store).

Two remote engines are configured; their generators are fakes (no server runs: a fake
generator stands in for each, their health probes and ``/slots`` reads find nothing at the
closed port). Engine ``fast`` has the fake timer's profile, engine ``slow`` one fitted on a
timer four times slower, so for a given budget ``fast`` carries more chunks.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from app.answering.pipeline import AnswerPipeline
from app.answering.state import AnswerRequest
from app.profile_store import save_profile
from app.services import Services
from app.settings import get_settings
from foundation.errors import NotFound, Unavailable
from generation.base import TokenEvent, TokenStream
from latency_model.calibration import calibrate
from latency_model.grid import quick_grid
from latency_model.profile import Profile
from tests.api.fakes import CharTokenizer, EchoGenerator, wrapped
from tests.latency_model.conftest import IDENTITY, TRUE_PREFILL, FakeTimer, no_cpu_probe
from tests.retrieval.fakes import HashingEmbedder

CLOSED = "http://127.0.0.1:9/v1"  # discard port: nothing listens, connections are refused
SLOW_IDENTITY = {**IDENTITY, "device_name": "Fake CPU 4x slower"}
TEXTS = {f"doc{i}.txt": f"Pump station note {i}. " + " ".join(
    f"The valve {i}-{j} is checked every {j + 2} weeks by the duty engineer." for j in range(12))
    for i in range(6)}
QUESTION = "How often is the valve checked?"


def engines_json(*ids: str, url: str = CLOSED) -> list[dict[str, Any]]:
    return [{"id": i, "kind": "remote", "base_url": url, "model": "m", "max_running": 1} for i in ids]


@pytest.fixture(scope="module")
def profiles() -> dict[str, Profile]:
    fast = calibrate(FakeTimer(), grid=quick_grid(8192, [200]), seed=3, progress=False,
                     cpu_probe=no_cpu_probe)
    slow = calibrate(FakeTimer(identity=SLOW_IDENTITY, prefill={k: 4 * v for k, v in TRUE_PREFILL.items()}),
                     grid=quick_grid(8192, [200]), seed=3, progress=False, cpu_probe=no_cpu_probe)
    return {"fast": fast, "slow": slow}


def fleet_services(root: Path, profiles: dict[str, Profile], ids: tuple[str, ...] = ("fast", "slow"),
                   **overrides: Any) -> Services:
    """Services over ``ids`` (each a fake generator with that engine's identity), corpus ingested."""
    from retrieval.chunking import ChunkerConfig
    from retrieval.store import IngestItem, ingest_batch

    settings = get_settings(data_dir=root / "data", database_url=f"sqlite:///{root / 'fleet.db'}",
                            auth_enabled=False, engines=engines_json(*ids), retrieval_candidates=6,
                            chunk_tokens=96, chunk_overlap_tokens=0, **overrides)
    services = Services(settings)
    tokenizer = CharTokenizer()
    services.__dict__["tokenizer"] = tokenizer
    services.__dict__["embedder"] = HashingEmbedder()
    gens = {}
    for i in ids:
        gen = EchoGenerator(tokenizer)
        gen.identity = dict(SLOW_IDENTITY if i == "slow" else IDENTITY)
        gens[i] = gen
    services.__dict__["generator"] = gens[ids[0]]
    services.__dict__["_engine_generators"] = {i: g for i, g in gens.items() if i != ids[0]}
    for p in profiles.values():
        save_profile(services.engine, services.data_dir, p)
    ingest_batch(services.engine, [IngestItem(document_id=k, text=v) for k, v in TEXTS.items()],
                 tokenizer=tokenizer, chunker_config=ChunkerConfig(96, 0), embedder=services.embedder)
    return services


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, profiles: dict[str, Profile]) -> Iterator[Services]:
    services = fleet_services(tmp_path_factory.mktemp("fleet"), profiles)
    yield services
    services.close()


def budget_between(pipe: AnswerPipeline) -> float:
    """A budget at which the fast engine fits more chunks than the slow one (from their plans)."""
    advice = pipe.prepare(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
    fast, slow = (pipe.engines[i].profile() for i in ("fast", "slow"))
    full = advice.full_prompt
    n, c = full.prompt_tokens_for(4), 0
    p95_fast = float(fast.predict_ttft_many([n], [c], [full.scaffold_len])[1][0])
    p95_slow = float(slow.predict_ttft_many([n], [c], [full.scaffold_len])[1][0])
    assert p95_slow > 2 * p95_fast
    return (p95_fast + p95_slow) / 2


# --- configuration -------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    '[{"id": "a", "base_url": "http://x/v1", "model": "m"}, '
    '{"id": "a", "base_url": "http://y/v1", "model": "m"}]',
    '[{"id": "a", "kind": "remote"}]',
    '[{"id": "a", "base_url": "ftp://x", "model": "m"}]',
    '[{"id": "has space", "kind": "local"}]',
    '[{"id": "l1", "kind": "local"}, {"id": "l2", "kind": "local"}]',
    '[{"id": "r", "base_url": "http://x/v1", "model": "m"}, {"id": "l", "kind": "local"}]',
    '[{"id": "a", "kind": "local", "base_url": "http://x/v1"}]',
    '[{"id": "a", "base_url": "http://x/v1", "model": "m", "max_running": 0}]',
    '[{"id": "a", "base_url": "http://x/v1", "model": "m", "colour": "red"}]',
    "[]", "not json",
])
def test_a_bad_engine_list_is_refused_at_start_with_invalid_config(
        bad: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli.main import main

    monkeypatch.setenv("RAGBUDGET_ENGINES", bad)
    monkeypatch.setenv("RAGBUDGET_DATA_DIR", str(tmp_path))
    with pytest.raises(ValidationError):
        get_settings()
    # `ragbudget serve` refuses to start: exit 2 with the code, before any database is opened
    assert main(["serve"]) == 2
    assert "[invalid_config]" in capsys.readouterr().err
    assert not (tmp_path / "ragbudget.db").exists()  # nothing written


def test_no_engine_list_is_the_one_default_engine_of_the_generator_settings() -> None:
    local = get_settings().engine_list()
    assert [(e.id, e.kind) for e in local] == [("default", "local")]
    remote = get_settings(generator_backend="remote", remote_base_url="http://h:1/v1", remote_model="m",
                          remote_max_running=3, remote_context_window=2048).engine_list()
    assert [(e.id, e.kind, e.base_url, e.model, e.max_running, e.context_window) for e in remote] == [
        ("default", "remote", "http://h:1/v1", "m", 3, 2048)]
    listed = get_settings(engines=engines_json("a", "b")).engine_list()
    assert [e.id for e in listed] == ["a", "b"]


# --- joint choice -------------------------------------------------------------------------
def test_the_answer_goes_to_the_engine_that_carries_more_context_and_the_receipt_says_so(
        fleet: Services) -> None:
    from receipts.chain import get_receipt_row, parse_body
    from receipts.verify import verify_chain

    pipe = AnswerPipeline(fleet)
    budget = budget_between(pipe)
    got = pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=budget))
    assert got.status == "ok" and got.predicted.engine_id == "fast"
    body = parse_body(get_receipt_row(fleet.engine, got.receipt_id).body)
    assert body["plan"]["engine_id"] == body["generator"]["engine_id"] == "fast"
    fleet_choice = body["plan"]["fleet"]
    assert fleet_choice["engine_id"] == "fast" and fleet_choice["fits"] is True
    by_id = {p["engine_id"]: p for p in fleet_choice["predictions"]}
    assert set(by_id) == {"fast", "slow"}
    assert by_id["fast"]["chosen_k"] > (by_id["slow"]["chosen_k"] or 0)
    assert by_id["slow"]["ttft_p95_ms"] > by_id["fast"]["ttft_p95_ms"]  # both priced at the fleet's k
    assert body["plan"]["profile_id"] == pipe.engines["fast"].profile().id
    assert verify_chain(fleet.engine).ok
    metrics = pipe.metrics.render().decode()
    assert 'ragbudget_engine_answers_total{engine="fast",status="ok"} 1.0' in metrics
    assert 'ragbudget_engine_up{engine="slow"} 1.0' in metrics


def test_an_engine_whose_queue_is_full_is_passed_over_rather_than_refusing(
        profiles: dict[str, Profile], tmp_path: Path) -> None:
    from app.answering.genqueue import Ticket

    services = fleet_services(tmp_path, profiles, queue_max=0)
    pipe = AnswerPipeline(services)
    slow = pipe.engines["slow"]
    slow.sync_slots()
    with slow.queue.slot(None, Ticket(prefill_ms=1.0, tpot_ms=1.0, max_new_tokens=1)):
        assert slow.queue.full()
        fast = pipe.engines["fast"]
        fast.sync_slots()
        with fast.queue.slot(None, Ticket(prefill_ms=1.0, tpot_ms=1.0, max_new_tokens=1)):
            from foundation.errors import Busy

            with pytest.raises(Busy):  # every engine full: 429 as with one engine
                pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
    with slow.queue.slot(None, Ticket(prefill_ms=1.0, tpot_ms=1.0, max_new_tokens=1)):
        got = pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
        assert got.status == "ok" and got.predicted.engine_id == "fast"
        planned = pipe.prepare(AnswerRequest(QUESTION)).fleet["predictions"]
        assert [p["engine_id"] for p in planned] == ["fast"]  # the full engine was not planned
    services.close()


def test_a_busy_engine_loses_the_request_to_one_that_can_still_carry_context(fleet: Services) -> None:
    from app.answering.genqueue import Ticket

    pipe = AnswerPipeline(fleet)
    budget = budget_between(pipe)
    fast = pipe.engines["fast"]
    fast.sync_slots()
    fleet.__dict__["_engine_generators"]["slow"].last_stats = None
    # the fast engine's one slot held by an answer predicted to run for a minute more
    with fast.queue.slot(None, Ticket(prefill_ms=60_000.0, tpot_ms=1.0, max_new_tokens=1)):
        got = pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=budget))
    assert got.predicted.engine_id == "slow" and got.status == "ok"
    assert fleet.__dict__["_engine_generators"]["slow"].last_stats is not None
    # the online correction of the slow engine's profile learned from it (one per profile, and
    # each engine has its own profile); the latency route reads it from that engine's bands
    slow_id, fast_id = pipe.engines["slow"].profile().id, pipe.engines["fast"].profile().id
    assert slow_id != fast_id
    assert pipe.bands_of(slow_id) is pipe.engines["slow"].bands
    assert pipe.bands_of(slow_id).correction_state(slow_id).n == 1


def test_load_from_other_clients_shows_in_the_engine_s_predicted_wait(fleet: Services) -> None:
    import time

    from generation.remote_load import SlotReading, parse_slots

    pipe = AnswerPipeline(fleet)
    fast = pipe.engines["fast"]
    advice = pipe.prepare(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
    assert {p["predicted_wait_ms"] for p in advice.fleet["predictions"]} == {0.0}
    assert fast.load is not None and fast.load.reading() is None  # nothing at the closed port
    # llama.cpp's /slots as it reads with its one slot decoding for another client: 40 tokens to go
    body = [{"id": 0, "is_processing": True, "next_token": [{"n_decoded": 24, "n_remain": 40}]}]
    reading = parse_slots(body, time.perf_counter())
    assert reading == SlotReading(total=1, busy=[(24, 40)], t=reading.t)
    fast.load._reading = reading  # what its background read would have kept
    tpot = fast.profile().predict_tpot_ms(8192 // 2)
    assert fast.predicted_wait_ms() == pytest.approx(40 * tpot)
    assert fast.queue.min_wait_ms() == 0.0  # never refused fast on a guess about foreign answers
    advice = pipe.prepare(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
    pred = {p["engine_id"]: p for p in advice.fleet["predictions"]}
    assert pred["fast"]["predicted_wait_ms"] == pytest.approx(40 * tpot)
    assert pred["slow"]["predicted_wait_ms"] == 0.0
    # once ragbudget's own answer holds that slot, the busy slot is its own: no foreign load;
    # but one granted a place and not yet sent waits there behind the other client's answer,
    # which its late-bound plan counts
    fast.sync_slots()
    with fast.queue.slot(None, None):
        assert fast.queue.foreign() == []
        assert fast.queue.engine_wait_ms() == pytest.approx(40 * tpot)
        bound = pipe.bind(replace(advice, engine_id="fast"))
        spent = bound.plan.overhead_ms - 40 * tpot
        assert 0.0 <= spent < 60_000.0
    fast.load._reading = None
    assert fast.queue.engine_wait_ms() == 0.0


LLAMA_METRICS = """# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
"""
VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
"""
SGLANG_METRICS = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
"""


def test_queue_metrics_of_llama_cpp_vllm_and_sglang_are_read_and_anything_else_is_not() -> None:
    from generation.remote_load import parse_queue_metrics

    assert parse_queue_metrics(LLAMA_METRICS) == (1, 2)
    assert parse_queue_metrics(VLLM_METRICS) == (5, 4)  # summed over label sets
    assert parse_queue_metrics(SGLANG_METRICS) == (7, 1)
    assert parse_queue_metrics("# TYPE other_gauge gauge\nother_gauge 3\n") is None
    assert parse_queue_metrics("<html>not metrics</html>") is None


def test_requests_an_engine_keeps_waiting_behind_its_slots_are_priced_as_foreign_work(
        fleet: Services) -> None:
    import time

    from generation.remote_load import SlotReading

    pipe = AnswerPipeline(fleet)
    fast = pipe.engines["fast"]
    pipe.prepare(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))  # starts its background reader
    assert fast.load is not None
    fast.sync_slots()
    tpot = fast.profile().predict_tpot_ms(8192 // 2)
    default_new = fleet.settings.default_max_new_tokens
    # one slot decoding for another client (40 tokens to go) and two more of its requests queued
    fast.load._reading = SlotReading(total=1, busy=[(24, 40)], t=time.perf_counter(), waiting=2)
    try:
        assert fast.predicted_wait_ms() == pytest.approx((40 + 2 * default_new) * tpot)
        assert fast.status()["engine_waiting"] == 2
        fast.load._reading = SlotReading(total=1, busy=[(24, 40)], t=time.perf_counter(), waiting=0)
        assert fast.predicted_wait_ms() == pytest.approx(40 * tpot)
    finally:
        fast.load._reading = None


class _MetricsOnly(http.server.BaseHTTPRequestHandler):
    """A server with vLLM's ``/metrics`` and no ``/slots`` (404)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/metrics":
            body = VLLM_METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


def test_an_engine_with_metrics_and_no_slots_route_is_read_from_its_metrics() -> None:
    from generation.remote_load import SlotLoad

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MetricsOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        load = SlotLoad(f"http://127.0.0.1:{server.server_address[1]}/v1", 0.05)
        reading = load.read_once()
        assert reading is not None and load.supported is False and load.metrics_supported is True
        assert (reading.total, reading.busy, reading.waiting) == (0, [(0, -1)] * 5, 4)
        assert load.reading() == reading
    finally:
        server.shutdown()


def test_engines_out_of_rotation_get_nothing_and_none_left_is_engine_unavailable(
        fleet: Services) -> None:
    pipe = AnswerPipeline(fleet)
    pipe.engines["fast"].health.mark_down("refused")  # probes go to a closed port: stays out
    got = pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
    assert got.predicted.engine_id == "slow"
    assert [p["engine_id"] for p in pipe.prepare(AnswerRequest(QUESTION)).fleet["predictions"]] == ["slow"]
    pipe.engines["slow"].health.mark_down("refused")
    with pytest.raises(Unavailable) as err:
        pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
    assert err.value.code == "engine_unavailable"
    # told when to come back (the next probe), so a client does not ask again at once
    assert err.value.details["retry_after_s"] == pytest.approx(
        min(e.health.interval_s for e in pipe.engines.values()))


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


def test_an_engine_out_of_rotation_is_probed_and_brought_back(tmp_path: Path) -> None:
    import functools

    from app.fleet import EngineHealth

    handler = functools.partial(_Quiet, directory=str(tmp_path))  # answers 404 for /v1/models
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    port = server.server_address[1]
    health = EngineHealth("e", f"http://127.0.0.1:{port}/v1/models", interval_s=0.05)
    health.mark_down("refused")
    assert not health.healthy and health.downs == 1
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()  # the engine answers again (any answer below 500)
    try:
        for _ in range(200):
            if health.healthy:
                break
            threading.Event().wait(0.05)
        assert health.healthy and health.reason is None
    finally:
        server.shutdown()


def test_a_refused_connection_takes_the_engine_out_of_rotation(fleet: Services) -> None:
    import httpx

    from app.fleet import engine_gone
    from foundation.errors import BackendError

    try:
        try:
            httpx.get(CLOSED + "/models", timeout=2.0)
        except httpx.HTTPError as exc:
            raise BackendError(f"remote generation failed: {exc}") from exc
    except BackendError as exc:
        assert engine_gone(exc)
    assert not engine_gone(BackendError("remote server answered HTTP 400: bad request"))


# --- replay -------------------------------------------------------------------------------
def test_replay_regenerates_on_the_recorded_engine_or_says_it_is_gone(
        fleet: Services, profiles: dict[str, Profile], tmp_path: Path) -> None:
    from app.answering.receipt_wiring import replay_receipt

    pipe = AnswerPipeline(fleet)
    pipe.engines["fast"].health.mark_down("refused")
    got = pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
    assert got.predicted.engine_id == "slow"
    slow = fleet.__dict__["_engine_generators"]["slow"]
    slow.last_stats = None
    report = replay_receipt(fleet, got.receipt_id, regenerate=True)
    assert report.check("regenerate").ok and slow.last_stats is not None  # regenerated on "slow"

    # a server whose engine list no longer has "slow" refuses to regenerate, by code
    other = Services(get_settings(data_dir=fleet.settings.data_dir, database_url=fleet.settings.database_url,
                                  auth_enabled=False, engines=engines_json("fast")))
    other.__dict__.update({"tokenizer": fleet.tokenizer, "embedder": fleet.embedder,
                           "generator": fleet.generator})
    with pytest.raises(NotFound) as err:
        replay_receipt(other, got.receipt_id, regenerate=True)
    assert err.value.code == "unknown_engine"
    assert replay_receipt(other, got.receipt_id).ok  # without regenerating it still replays
    other.close()


# --- faults -------------------------------------------------------------------------------
class DyingGenerator(EchoGenerator):
    """Streams ``after`` tokens, then fails as a remote engine whose connection was refused or cut."""

    def __init__(self, tokenizer: CharTokenizer, after: int) -> None:
        super().__init__(tokenizer)
        self.after = after
        self.calls = 0

    def stream(self, prompt_ids: list[int], **kwargs: Any) -> TokenStream:
        import httpx

        from foundation.errors import BackendError

        def events(inner: TokenStream) -> Iterator[TokenEvent]:
            self.calls += 1
            for i, ev in enumerate(inner):
                if i == self.after:
                    break
                yield ev
            inner.close()
            try:
                raise httpx.ConnectError("[Errno 111] Connection refused")
            except httpx.ConnectError as exc:
                raise BackendError(f"remote generation failed: {exc}") from exc

        return wrapped(super().stream(prompt_ids, **kwargs), events)


def test_a_stream_that_dies_before_its_first_token_is_answered_once_by_another_engine(
        profiles: dict[str, Profile], tmp_path: Path) -> None:
    from receipts.chain import get_receipt_row, parse_body
    from receipts.verify import verify_chain

    services = fleet_services(tmp_path, profiles)
    dying = DyingGenerator(services.tokenizer, after=0)  # type: ignore[arg-type]
    dying.identity = dict(IDENTITY)
    services.__dict__["generator"] = dying  # engine "fast" refuses
    pipe = AnswerPipeline(services)
    got = pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
    assert dying.calls == 1 and got.status == "ok" and got.text == "fake answer"
    assert got.predicted.engine_id == "slow" and not pipe.engines["fast"].healthy
    body = parse_body(get_receipt_row(services.engine, got.receipt_id).body)
    assert body["generator"]["engine_id"] == "slow" and body["plan"]["fleet"]["retried_from"] == "fast"
    assert body["status"] == "ok"
    assert verify_chain(services.engine).ok
    # the next answer does not try the engine out of rotation
    again = pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
    assert again.predicted.engine_id == "slow" and dying.calls == 1
    metrics = pipe.metrics.render().decode()
    assert 'ragbudget_engine_retries_total{engine="fast"} 1.0' in metrics
    assert 'ragbudget_engine_up{engine="fast"} 0.0' in metrics
    services.close()


def test_an_engine_that_dies_mid_answer_ends_it_with_backend_error_and_its_receipt(
        profiles: dict[str, Profile], tmp_path: Path) -> None:
    from receipts.chain import get_receipt_row, parse_body

    services = fleet_services(tmp_path, profiles)
    dying = DyingGenerator(services.tokenizer, after=3)  # type: ignore[arg-type]
    dying.identity = dict(IDENTITY)
    services.__dict__["generator"] = dying
    pipe = AnswerPipeline(services)
    got = pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))
    assert got.status == "failed" and got.error is not None and got.error.code == "backend_error"
    assert got.text == "fak" and dying.calls == 1  # not retried: tokens were already sent
    assert got.receipt_status == "written"
    body = parse_body(get_receipt_row(services.engine, got.receipt_id).body)
    assert body["status"] == "failed" and body["generator"]["engine_id"] == "fast"
    assert not pipe.engines["fast"].healthy
    services.close()


def test_the_benchmark_baselines_route_in_turn_or_by_least_ttft_at_a_fixed_k(fleet: Services) -> None:
    pipe = AnswerPipeline(fleet)
    pipe.routing, pipe.fixed_k = "round_robin", 2
    got = [pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=1.0)) for _ in range(4)]
    assert [g.predicted.engine_id for g in got] == ["fast", "slow", "fast", "slow"]
    assert {(g.chosen_k, g.binding) for g in got} == {(2, "fixed")}  # whatever the budget
    pipe.routing = "least_ttft"
    assert {pipe.answer(AnswerRequest(QUESTION)).predicted.engine_id for _ in range(2)} == {"fast"}
    pipe.routing, pipe.fixed_k = "joint", None
    assert pipe.answer(AnswerRequest(QUESTION, ttft_budget_ms=1.0)).binding == "nothing_fits"


def test_calibrate_times_the_engine_it_is_given(fleet: Services) -> None:
    from app.cli.latency_cmds import calibrate_profile

    got = calibrate_profile(fleet, quick=True, cached_tokens=[], progress=False, save=False, engine="slow")
    assert got["engine_id"] == "slow" and got["device_name"] == SLOW_IDENTITY["device_name"]
    first = calibrate_profile(fleet, quick=True, cached_tokens=[], progress=False, save=False)
    assert first["engine_id"] == "fast" and first["device_name"] == IDENTITY["device_name"]
    with pytest.raises(NotFound) as err:
        calibrate_profile(fleet, quick=True, cached_tokens=[], progress=False, save=False, engine="gone")
    assert err.value.code == "unknown_engine"


def test_engines_route_lists_every_engine_with_its_health_queue_and_other_clients_load(
        fleet: Services) -> None:
    import time

    from fastapi.testclient import TestClient

    from app.api.app import create_app
    from generation.remote_load import SlotReading

    app = create_app(services=fleet)
    with TestClient(app) as client:
        pipe = app.state.pipeline
        got = client.get("/v1/engines")
        assert got.status_code == 200, got.text
        assert [e["id"] for e in got.json()] == ["fast", "slow"]
        assert {e["healthy"] for e in got.json()} == {True}
        client.post("/v1/advise", json={"question": QUESTION, "ttft_budget_ms": 60_000.0})
        fast = pipe.engines["fast"]
        fast.sync_slots()
        assert fast.load is not None
        fast.load._reading = SlotReading(total=1, busy=[(0, 10)], t=time.perf_counter(), waiting=1)
        pipe.engines["slow"].health.mark_down("refused")
        body = {e["id"]: e for e in client.get("/v1/engines").json()}
        assert (body["fast"]["engine_busy"], body["fast"]["engine_waiting"]) == (1, 1)
        assert body["fast"]["foreign_busy"] == 2 and body["fast"]["predicted_wait_ms"] > 0.0
        assert body["fast"]["profile_id"] == fast.profile().id
        assert (body["slow"]["healthy"], body["slow"]["down_reason"]) == (False, "refused")
        fast.load._reading = None


def test_engine_unavailable_over_http_says_when_to_come_back() -> None:
    """Every engine out of rotation: 503 ``engine_unavailable`` with ``Retry-After`` (the next
    probe, whole seconds, at least 1), so clients that honour it do not ask again at once."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from app.api.errors import install_error_handlers

    api = FastAPI()
    install_error_handlers(api)

    @api.get("/v1/answer-stub")
    def _down() -> None:
        raise Unavailable("no engine is in rotation", code="engine_unavailable",
                          engines={"a": "refused"}, retry_after_s=1.5)

    r = TestClient(api).get("/v1/answer-stub")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert r.headers["Retry-After"] == "2" and r.headers["x-should-retry"] == "true"
