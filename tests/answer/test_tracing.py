"""Answers as OpenTelemetry traces (app.tracing): one trace per answer that agrees with its receipt.

The pipeline runs for real over fake model services (tests/api/fakes.py: a code-point
tokenizer, a hashing embedder, a generator that echoes a fixed reply), so no model loads.
Spans go to OpenTelemetry's in-memory exporter, or (marker ``tracing``) over OTLP/HTTP to
a real Arize Phoenix server (``bash scripts/install_phoenix.sh``) and are read back through
Phoenix's REST API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.answering.pipeline import AnswerPipeline
from app.answering.state import AnswerRequest
from app.services import Services
from app.settings import Settings
from generation.base import TokenEvent, TokenStream
from latency_model.calibration import calibrate
from latency_model.grid import quick_grid
from latency_model.profile import Profile
from receipts.chain import get_receipt
from tests.api.conftest import api_settings, services_with_docs
from tests.api.fakes import CharTokenizer, EchoGenerator, wrapped
from tests.latency_model.conftest import FakeTimer, no_cpu_probe

REPO = Path(__file__).resolve().parents[2]
DOCS = {"pump.txt": "Zebrafish sentinel paragraph: the circulation pump is painted vermilion.",
        "valve.txt": "The relief valve on the second loop is painted green.",
        "tank.txt": "The header tank holds forty litres of treated water."}
QUESTION = "What colour is the circulation pump?"


@pytest.fixture(scope="module")
def profile() -> Profile:
    """A profile fitted on the fake timer (the fake generator's identity), as tests/api uses."""
    return calibrate(FakeTimer(), grid=quick_grid(8192, [200]), seed=3, progress=False,
                     cpu_probe=no_cpu_probe)


def fake_services(root: Path, profile: Profile, generator: Any = None, **overrides: Any) -> Services:
    """Fake model services on SQLite under ``root`` (auth off) with :data:`DOCS` ingested;
    ``generator`` default: the fake echo generator."""
    settings = api_settings(root, auth_enabled=False, default_max_new_tokens=6, **overrides)
    return services_with_docs(settings, profile, generator, DOCS)


class Traced:
    """A pipeline whose tracer exports to OpenTelemetry's in-memory exporter."""

    def __init__(self, services: Services, settings: Settings, exporter: Any = None) -> None:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from app.tracing import AnswerTracer

        self.services = services
        self.pipeline = AnswerPipeline(services)
        self.memory = InMemorySpanExporter()
        self.pipeline.tracer = AnswerTracer(settings, self.pipeline.metrics,
                                            exporter=exporter or self.memory)

    def spans(self) -> dict[str, Any]:
        """The finished spans by name (after a flush), the LLM span under ``generate``."""
        assert self.pipeline.tracer is not None and self.pipeline.tracer.flush()
        return {("generate" if s.name.startswith("chat ") else s.name): s
                for s in self.memory.get_finished_spans()}


@pytest.fixture
def traced(tmp_path: Path, profile: Profile) -> Iterator[Traced]:
    services = fake_services(tmp_path, profile)
    yield Traced(services, services.settings.model_copy(update={"public_base_url": "https://rb.example"}))
    services.close()


def ask(pipeline: AnswerPipeline, question: str = QUESTION) -> Any:
    answer = pipeline.answer(AnswerRequest(question=question, ttft_budget_ms=5000))
    assert answer.status == "ok" and answer.receipt_id, answer
    return answer


def test_tracing_off_never_imports_the_opentelemetry_sdk(tmp_path: Path) -> None:
    # The SDK, exporter and protobuf messages tracing would load; the API package alone is
    # imported by FastAPI itself (fastapi.telemetry), a no-op without a configured provider.
    script = f"""
import sys
OURS = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")
from pathlib import Path
from tests.answer.test_tracing import ask, fake_services, FakeTimer, calibrate, quick_grid, no_cpu_probe
from app.answering.pipeline import AnswerPipeline
profile = calibrate(FakeTimer(), grid=quick_grid(8192, [200]), seed=3, progress=False, cpu_probe=no_cpu_probe)
services = fake_services(Path({str(tmp_path)!r}), profile)
pipeline = AnswerPipeline(services)
ask(pipeline)
print("tracer", pipeline.tracer)
print("modules", sorted(m for m in sys.modules if m.startswith(OURS)))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAGBUDGET_OTLP_ENDPOINT": ""}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tracer None" in out.stdout
    assert "modules []" in out.stdout, out.stdout


def test_no_tracer_exists_without_an_endpoint(tmp_path: Path, profile: Profile) -> None:
    services = fake_services(tmp_path, profile)
    try:
        assert AnswerPipeline(services).tracer is None
    finally:
        services.close()


def test_an_answer_is_one_trace_of_a_root_with_retrieve_and_generate(traced: Traced) -> None:
    ask(traced.pipeline)
    spans = traced.spans()
    assert set(spans) == {"answer", "retrieve", "generate"}
    root = spans["answer"]
    assert root.parent is None
    for child in (spans["retrieve"], spans["generate"]):
        assert child.context.trace_id == root.context.trace_id
        assert child.parent.span_id == root.context.span_id
    kinds = {n: s.attributes["openinference.span.kind"] for n, s in spans.items()}
    assert kinds == {"answer": "CHAIN", "retrieve": "RETRIEVER", "generate": "LLM"}


def test_two_answers_are_two_traces(traced: Traced) -> None:
    ask(traced.pipeline)
    ask(traced.pipeline, "Which valve is green?")
    assert traced.pipeline.tracer is not None and traced.pipeline.tracer.flush()
    roots = [s for s in traced.memory.get_finished_spans() if s.name == "answer"]
    assert len({s.context.trace_id for s in roots}) == 2


def test_root_names_the_receipt_and_links_its_console_page(traced: Traced) -> None:
    answer = ask(traced.pipeline)
    attrs = traced.spans()["answer"].attributes
    assert attrs["ragbudget.receipt.id"] == answer.receipt_id
    assert attrs["ragbudget.receipt.url"] == f"https://rb.example/ui/receipts/{answer.receipt_id}"


def test_retrieve_span_carries_every_candidate_as_the_receipt_has_it(traced: Traced) -> None:
    answer = ask(traced.pipeline)
    candidates = get_receipt(traced.services.engine, answer.receipt_id)["candidates"]
    attrs = traced.spans()["retrieve"].attributes
    assert len(candidates) == len(DOCS)
    for i, c in enumerate(candidates):
        pre = f"retrieval.documents.{i}.document"
        meta = json.loads(attrs[f"{pre}.metadata"])
        assert attrs[f"{pre}.id"] == c["document_id"]
        assert attrs[f"{pre}.score"] == c["score"]
        assert (meta["version"], meta["chunk_id"], meta["rank"], meta["chunk_hash"]) == (
            c["version"], str(c["chunk_id"]), c["rank"], c["chunk_hash"])
    gen_ai_docs = json.loads(attrs["gen_ai.retrieval.documents"])
    assert [(d["id"], d["score"]) for d in gen_ai_docs] == [
        (c["document_id"], c["score"]) for c in candidates]


def test_generate_span_carries_the_receipts_model_tokens_and_timings(traced: Traced) -> None:
    answer = ask(traced.pipeline)
    body = get_receipt(traced.services.engine, answer.receipt_id)
    a = traced.spans()["generate"].attributes
    p, t = body["prompt"], body["timings"]
    assert a["gen_ai.request.model"] == a["llm.model_name"] == body["generator"]["model_id"]
    assert a["gen_ai.usage.input_tokens"] == a["llm.token_count.prompt"] == p["prompt_tokens"]
    assert a["gen_ai.usage.cache_read.input_tokens"] == p["cached_tokens"]
    assert a["ragbudget.tokens.computed"] == p["computed_tokens"]
    n_out = body["output"]["output_tokens"]
    assert a["gen_ai.usage.output_tokens"] == a["llm.token_count.completion"] == n_out
    assert (a["ragbudget.ttft_ms"], a["ragbudget.tpot_ms"], a["ragbudget.queue_ms"]) == (
        t["ttft_ms"], t["tpot_ms"], t["queue_ms"])
    assert a["gen_ai.response.time_to_first_chunk"] == t["ttft_ms"] / 1000.0
    assert a["gen_ai.response.id"] == answer.receipt_id
    assert list(a["gen_ai.response.finish_reasons"]) == [body["output"]["finish_reason"]]


def test_root_carries_the_plan(traced: Traced) -> None:
    answer = ask(traced.pipeline)
    plan = get_receipt(traced.services.engine, answer.receipt_id)["plan"]
    a = traced.spans()["answer"].attributes
    assert (a["ragbudget.plan.chosen_k"], a["ragbudget.plan.binding"], a["ragbudget.plan.profile_id"]) == (
        plan["chosen_k"], plan["binding"], plan["profile_id"])
    assert (a["ragbudget.plan.predicted_ttft_p50_ms"], a["ragbudget.plan.predicted_ttft_p95_ms"]) == (
        plan["predicted_ttft_p50_ms"], plan["predicted_ttft_p95_ms"])


def test_span_times_follow_the_receipts_timings(traced: Traced) -> None:
    answer = ask(traced.pipeline)
    t = get_receipt(traced.services.engine, answer.receipt_id)["timings"]
    spans = traced.spans()
    root, gen = spans["answer"], spans["generate"]
    arrival = root.start_time

    def ms(ns: int) -> float:
        return (ns - arrival) / 1e6

    assert ms(root.end_time) == pytest.approx(t["total_ms"], abs=1e-3)
    assert ms(gen.start_time) == pytest.approx(t["ttft_ms"] - t["prefill_ms"], abs=1e-3)
    [first] = [e for e in gen.events if e.name == "first_token"]
    assert ms(first.timestamp) == pytest.approx(t["ttft_ms"], abs=1e-3)
    retrieve = spans["retrieve"]
    assert (retrieve.end_time - retrieve.start_time) / 1e6 == pytest.approx(t["retrieval_ms"], abs=1e-3)


def test_no_text_is_exported_by_default(traced: Traced) -> None:
    answer = ask(traced.pipeline)
    values = [str(v) for s in traced.spans().values() for v in s.attributes.values()]
    for text in [QUESTION, answer.text, *DOCS.values()]:
        assert not any(text in v for v in values), text


def test_text_is_exported_when_asked(tmp_path: Path, profile: Profile) -> None:
    services = fake_services(tmp_path, profile)
    try:
        traced = Traced(services, services.settings.model_copy(update={"otlp_export_text": True}))
        answer = ask(traced.pipeline)
        spans = traced.spans()
        assert spans["answer"].attributes["input.value"] == QUESTION
        assert spans["generate"].attributes["output.value"] == answer.text
        contents = {v for k, v in spans["retrieve"].attributes.items() if k.endswith(".document.content")}
        assert any(DOCS["pump.txt"] in c for c in contents)
    finally:
        services.close()


class FailingGenerator(EchoGenerator):
    """The fake generator, failing after its second token."""

    def stream(self, prompt_ids: list[int], **kw: Any) -> TokenStream:
        from foundation.errors import BackendError

        def events(inner: TokenStream) -> Iterator[TokenEvent]:
            for i, ev in enumerate(inner):
                if i == 2:
                    inner.close()
                    raise BackendError("simulated device fault")
                yield ev

        return wrapped(super().stream(prompt_ids, **kw), events)


def test_a_failed_answer_marks_its_root_and_generate_spans_as_errors(tmp_path: Path,
                                                                     profile: Profile) -> None:
    from opentelemetry.trace import StatusCode

    services = fake_services(tmp_path, profile, FailingGenerator(CharTokenizer()))
    try:
        traced = Traced(services, services.settings)
        answer = traced.pipeline.answer(AnswerRequest(question=QUESTION, ttft_budget_ms=5000))
        assert answer.status == "failed"
        spans = traced.spans()
    finally:
        services.close()
    for name in ("answer", "generate"):
        assert spans[name].status.status_code == StatusCode.ERROR
        assert "simulated device fault" in (spans[name].status.description or "")
    assert spans["generate"].attributes["error.type"] == "backend_error"
    assert spans["answer"].attributes["ragbudget.receipt.id"] == answer.receipt_id


class FailingExporter:
    """A span exporter whose every export raises."""

    def export(self, spans: Any) -> Any:
        raise ConnectionError("collector down")

    def shutdown(self) -> None:
        pass


def test_a_failing_exporter_fails_no_answer_and_is_counted(tmp_path: Path, profile: Profile) -> None:
    services = fake_services(tmp_path, profile)
    try:
        traced = Traced(services, services.settings, exporter=FailingExporter())
        answer = ask(traced.pipeline)
        assert get_receipt(services.engine, answer.receipt_id)["status"] == "ok"
        assert traced.pipeline.tracer is not None
        traced.pipeline.tracer.flush()
        metrics = traced.pipeline.metrics.render().decode()
        assert "ragbudget_trace_export_failures_total 3.0" in metrics
    finally:
        services.close()


class StuckExporter:
    """A span exporter that holds every export until ``release`` is set (``done`` after)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.done = threading.Event()

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.entered.set()
        self.release.wait(120)
        self.done.set()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def test_an_exporter_that_hangs_does_not_hold_the_answer(tmp_path: Path, profile: Profile) -> None:
    services = fake_services(tmp_path, profile)
    stuck = StuckExporter()
    try:
        traced = Traced(services, services.settings, exporter=stuck)
        tracer = traced.pipeline.tracer
        assert tracer is not None
        ask(traced.pipeline)
        threading.Thread(target=tracer.flush, daemon=True).start()  # the export starts, and hangs
        assert stuck.entered.wait(30)
        answer = ask(traced.pipeline, "Which valve is green?")
        assert not stuck.done.is_set()  # answered and receipted while the exporter still hangs
        assert get_receipt(services.engine, answer.receipt_id)["status"] == "ok"
    finally:
        stuck.release.set()
        services.close()


def test_two_tracers_on_one_metrics_registry_share_its_counters(tmp_path: Path) -> None:
    from app.metrics import AnswerMetrics
    from app.tracing import AnswerTracer

    metrics, settings = AnswerMetrics(), api_settings(tmp_path)
    first = AnswerTracer(settings, metrics, exporter=FailingExporter())
    second = AnswerTracer(settings, metrics, exporter=FailingExporter())
    assert second.failures is first.failures


def test_tracing_on_without_opentelemetry_is_a_config_error(tmp_path: Path, profile: Profile,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from app.tracing import answer_tracer
    from foundation.errors import InvalidConfig

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails as if missing
    settings = api_settings(tmp_path, otlp_endpoint="http://127.0.0.1:9/v1/traces")
    with pytest.raises(InvalidConfig, match="tracing extra"):
        answer_tracer(settings)


def test_an_endpoint_that_is_not_an_http_url_is_refused_at_start(tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="otlp_endpoint must be an http"):
        api_settings(tmp_path, otlp_endpoint="127.0.0.1:4318")


# --- a real trace backend: Arize Phoenix ---------------------------------------------------

@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Phoenix server (``.venv-phoenix``); skipped when not installed unless
    ``RAGBUDGET_REQUIRE_PHOENIX=1``."""
    from foundation.errors import InvalidConfig
    from ragbudget_testing.phoenix import INSTALL, PhoenixServer, phoenix_python

    try:
        phoenix_python()
    except InvalidConfig as exc:
        if os.environ.get("RAGBUDGET_REQUIRE_PHOENIX") == "1":
            pytest.fail(f"Phoenix is required (RAGBUDGET_REQUIRE_PHOENIX=1): {exc}")
        pytest.skip(f"Phoenix is not installed; run `{INSTALL}`")
    with PhoenixServer(tmp_path_factory.mktemp("phoenix")) as server:
        yield server


@pytest.mark.tracing
def test_phoenix_shows_each_answer_with_its_receipt_documents_and_tokens(
        phoenix: Any, tmp_path: Path, profile: Profile) -> None:
    services = fake_services(tmp_path, profile, otlp_endpoint=phoenix.otlp_endpoint,
                             otlp_service_name="ragbudget-test")
    try:
        pipeline = AnswerPipeline(services)
        answers = [ask(pipeline), ask(pipeline, "Which valve is green?")]
        bodies = {a.receipt_id: get_receipt(services.engine, a.receipt_id) for a in answers}
        assert pipeline.tracer is not None and pipeline.tracer.flush()
        spans = phoenix.wait_spans("ragbudget-test", 3 * len(answers))
    finally:
        services.close()
    roots = {s["attributes"]["ragbudget.receipt.id"]: s for s in spans if s["name"] == "answer"}
    assert set(roots) == set(bodies)
    for answer in answers:
        body = bodies[answer.receipt_id]
        trace_id = roots[answer.receipt_id]["context"]["trace_id"]
        trace = [s for s in spans if s["context"]["trace_id"] == trace_id]
        by_kind = {s["span_kind"]: s["attributes"] for s in trace}
        assert set(by_kind) == {"CHAIN", "RETRIEVER", "LLM"}
        docs = by_kind["RETRIEVER"]
        for i, c in enumerate(body["candidates"]):
            assert docs[f"retrieval.documents.{i}.document.id"] == c["document_id"]
            assert docs[f"retrieval.documents.{i}.document.score"] == pytest.approx(c["score"], rel=1e-12)
        llm = by_kind["LLM"]
        assert llm["llm.token_count.prompt"] == body["prompt"]["prompt_tokens"]
        assert llm["llm.token_count.completion"] == body["output"]["output_tokens"]
        assert llm["gen_ai.usage.input_tokens"] == body["prompt"]["prompt_tokens"]
        assert llm["ragbudget.ttft_ms"] == pytest.approx(body["timings"]["ttft_ms"], rel=1e-12)
