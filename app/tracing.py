"""Every answer as one OpenTelemetry trace, exported over OTLP/HTTP (docs/tracing.md).

Off unless ``otlp_endpoint`` is set (:mod:`app.settings`); off, :func:`answer_tracer`
returns None and nothing here imports OpenTelemetry, so the answer path pays nothing.
On, :meth:`AnswerTracer.export` turns each finished :class:`app.answering.types.Answer`
into spans, with the attribute names of both the OpenTelemetry GenAI semantic
conventions (``gen_ai.*``) and OpenInference (``openinference.span.kind``,
``retrieval.documents.*``, ``llm.*``; what Arize Phoenix reads), plus ``ragbudget.*``
for what neither names::

    answer     CHAIN      receipt id and console link, status, budget, the plan
    ├─ retrieve  RETRIEVER  every candidate: document id, version, chunk id, score, rank
    └─ generate  LLM        model, prompt/cached/computed/output tokens, TTFT, TPOT, queue

The spans are laid out on the answer's own clock, from the receipt's timings (ms after the
request's arrival, :mod:`app.answering.pipeline`): ``answer`` spans ``[0, total_ms]``; ``generate``
starts when the model was granted (``ttft_ms - prefill_ms``) and has a ``first_token`` event
at ``ttft_ms``; ``retrieve`` lasts ``retrieval_ms`` and ends where the first plan started
(``overhead_ms``). Arrival is mapped to wall-clock time once per answer.

Text (question, retrieval query, chunk text, answer) is exported only with
``otlp_export_text``: receipts may hold sensitive text, and a trace store has its own
readers and retention. Spans are queued to a ``BatchSpanProcessor`` and sent from its
thread, so an answer never waits for the exporter; a failed export is logged and counted
(``ragbudget_trace_export_failures_total``), never raised.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.answering.state import Prepared
    from app.answering.types import Answer
    from app.metrics import AnswerMetrics
    from app.settings import Settings
    from generation.base import GenParams

log = logging.getLogger("ragbudget.tracing")

AttrValue = str | bool | int | float | list[str]

#: The trace counters of each metrics registry (exported, export failures, build failures).
_COUNTERS: weakref.WeakKeyDictionary[Any, tuple[Any, Any, Any]] = weakref.WeakKeyDictionary()


@dataclass
class SpanSpec:
    """One span to emit: ``start_ms``/``end_ms`` after the answer's arrival, its parent's index
    in the list (None: the root), attributes, events ``(name, at_ms)`` and an error message
    (None: status unset)."""

    name: str
    start_ms: float
    end_ms: float
    parent: int | None
    attributes: dict[str, AttrValue]
    events: list[tuple[str, float]] = field(default_factory=list)
    error: str | None = None


def receipt_url(settings: Settings, receipt_id: str) -> str:
    """The console page of ``receipt_id`` (``/ui/receipts/<id>``, :mod:`app.ui.views_receipts`)
    under ``public_base_url``, default ``http://<host>:<port>``."""
    base = settings.public_base_url or f"http://{settings.host}:{settings.port}"
    return f"{base.rstrip('/')}/ui/receipts/{receipt_id}"


def _put(attrs: dict[str, AttrValue], key: str, value: Any) -> None:
    """Set ``key`` unless ``value`` is None (OpenTelemetry attributes cannot be null)."""
    if value is not None:
        attrs[key] = value


def answer_spans(p: Prepared, params: GenParams, summary: Answer, identity: dict[str, Any], *,
                 export_text: bool, console_url: str | None) -> list[SpanSpec]:
    """The spans of one finished answer (root first), pure: no OpenTelemetry, no clock.

    ``identity``: the generator's (:attr:`generation.base.Generator.identity`);
    ``console_url``: the receipt's console page (None: no receipt was written).
    """
    t, tok = summary.timings, summary.tokens
    total_ms = t.total_ms if t.total_ms is not None else 0.0
    model = str(identity.get("model_id") or "unknown")
    receipt_id = summary.receipt_id
    status_error = (f"{summary.error.code}: {summary.error.message}" if summary.error is not None
                    else "failed" if summary.status == "failed" else None)

    root: dict[str, AttrValue] = {
        "openinference.span.kind": "CHAIN", "gen_ai.operation.name": "invoke_workflow",
        "gen_ai.workflow.name": "ragbudget.answer", "ragbudget.status": summary.status,
        "ragbudget.ttft_budget_ms": summary.ttft_budget_ms, "ragbudget.corpus.revision": summary.revision,
        "ragbudget.plan.chosen_k": summary.chosen_k, "ragbudget.plan.binding": summary.binding,
        "ragbudget.plan.profile_id": summary.predicted.profile_id,
        "ragbudget.plan.profile_source": summary.predicted.profile_source,
        "ragbudget.plan.late_bound": summary.predicted.late_bound,
        "ragbudget.plan.overhead_ms": summary.predicted.overhead_ms,
    }
    _put(root, "ragbudget.receipt.id", receipt_id)
    _put(root, "ragbudget.receipt.url", console_url)
    _put(root, "ragbudget.receipt.error", summary.receipt_error)
    _put(root, "ragbudget.plan.predicted_ttft_p50_ms", summary.predicted.ttft_p50_ms)
    _put(root, "ragbudget.plan.predicted_ttft_p95_ms", summary.predicted.ttft_p95_ms)
    _put(root, "ragbudget.plan.predicted_wait_ms", summary.predicted.wait_ms)
    _put(root, "ragbudget.within_budget", summary.within_budget)
    _put(root, "ragbudget.budget_miss_cause", summary.budget_miss_cause)
    for name in ("ttft_ms", "tpot_ms", "queue_ms", "total_ms", "auth_ms", "retrieval_ms",
                 "planning_ms", "prefill_ms", "overhead_ms"):
        _put(root, f"ragbudget.{name}", getattr(t, name))
    if export_text:
        root.update({"input.value": summary.question, "input.mime_type": "text/plain",
                     "output.value": summary.text, "output.mime_type": "text/plain"})

    r = p.retrieval
    docs: list[dict[str, Any]] = []
    retrieve: dict[str, AttrValue] = {
        "openinference.span.kind": "RETRIEVER", "gen_ai.operation.name": "retrieval",
        "gen_ai.data_source.id": "ragbudget.corpus", "ragbudget.corpus.revision": r.revision,
        "ragbudget.embedder.id": r.embedder_id, "ragbudget.retrieval.k_candidates": r.k,
        "ragbudget.retrieval.query_truncated": r.query_truncated,
    }
    _put(retrieve, "ragbudget.corpus.root_hash", r.root_hash)
    from app.prompting.slots import hit_slots

    for i, (h, slot) in enumerate(zip(r.hits, hit_slots(r.hits), strict=True)):
        meta = {"version": h.version, "chunk_id": str(h.chunk_id), "chunk_hash": h.chunk_hash,
                "rank": h.rank, "slot": slot, "cited": slot <= summary.chosen_k}
        pre = f"retrieval.documents.{i}.document"
        retrieve[f"{pre}.id"] = h.document_id
        retrieve[f"{pre}.score"] = float(h.score)
        retrieve[f"{pre}.metadata"] = json.dumps(meta, sort_keys=True)
        if export_text:
            retrieve[f"{pre}.content"] = h.text
        docs.append({"id": h.document_id, "score": float(h.score), **meta})
    retrieve["gen_ai.retrieval.documents"] = json.dumps(docs, sort_keys=True)
    if export_text:
        retrieve.update({"input.value": p.query, "gen_ai.retrieval.query.text": p.query})
    retrieval_ms = t.retrieval_ms or 0.0
    retrieve_end = t.overhead_ms if t.overhead_ms is not None else retrieval_ms

    invocation = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                  "top_p": params.top_p, "seed": params.seed}
    llm: dict[str, AttrValue] = {
        "openinference.span.kind": "LLM", "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": f"ragbudget.{identity.get('backend') or 'local'}",
        "gen_ai.request.model": model, "gen_ai.response.model": model, "llm.model_name": model,
        "llm.invocation_parameters": json.dumps(invocation, sort_keys=True),
        "gen_ai.request.max_tokens": params.max_new_tokens,
        "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
        "gen_ai.usage.input_tokens": tok.prompt, "gen_ai.usage.output_tokens": tok.output,
        "gen_ai.usage.cache_read.input_tokens": tok.cached,
        "llm.token_count.prompt": tok.prompt, "llm.token_count.completion": tok.output,
        "llm.token_count.total": tok.prompt + tok.output,
        "llm.token_count.prompt_details.cache_read": tok.cached,
        "ragbudget.tokens.computed": tok.computed, "ragbudget.status": summary.status,
        "ragbudget.finish_reason": summary.finish_reason,
        "gen_ai.response.finish_reasons": [summary.finish_reason],
    }
    _put(llm, "gen_ai.request.seed", params.seed)
    _put(llm, "gen_ai.response.id", receipt_id)
    _put(llm, "ragbudget.generator.device", identity.get("device"))
    _put(llm, "ragbudget.generator.dtype", identity.get("dtype"))
    _put(llm, "ragbudget.generator.weights_hash", identity.get("weights_hash"))
    for name in ("ttft_ms", "tpot_ms", "queue_ms", "prefill_ms"):
        _put(llm, f"ragbudget.{name}", getattr(t, name))
    if t.ttft_ms is not None:
        llm["gen_ai.response.time_to_first_chunk"] = t.ttft_ms / 1000.0  # seconds, from arrival
    if status_error is not None:
        llm["error.type"] = summary.error.code if summary.error is not None else "failed"
    if export_text:
        llm.update({"output.value": summary.text, "output.mime_type": "text/plain"})
    if t.ttft_ms is not None and t.prefill_ms is not None:
        granted_ms = t.ttft_ms - t.prefill_ms
    else:  # no first token: the model was granted after the plan and the wait, if at all
        granted_ms = min(total_ms, (t.overhead_ms or 0.0) + (t.queue_ms or 0.0))
    events = [("first_token", t.ttft_ms)] if t.ttft_ms is not None else []

    return [
        SpanSpec("answer", 0.0, total_ms, None, root, error=status_error),
        SpanSpec("retrieve", max(retrieve_end - retrieval_ms, 0.0), retrieve_end, 0, retrieve),
        SpanSpec(f"chat {model}", granted_ms, max(total_ms, granted_ms), 0, llm, events, status_error),
    ]


def _headers(raw: str) -> dict[str, str]:
    """``key=value,key2=value2`` (the OTEL_EXPORTER_OTLP_HEADERS form) as a dict; values may be
    percent-encoded."""
    from urllib.parse import unquote

    out: dict[str, str] = {}
    for part in raw.split(","):
        key, sep, value = part.partition("=")
        if sep and key.strip():
            out[key.strip()] = unquote(value.strip())
    return out


class AnswerTracer:
    """Exports answers as traces through one ``TracerProvider`` with a ``BatchSpanProcessor``.

    ``exporter``: the span exporter (default: OTLP/HTTP protobuf to ``settings.otlp_endpoint``);
    ``metrics``: the app's :class:`app.metrics.AnswerMetrics`, whose registry gets the trace
    counters (spans exported, spans whose export failed, answers whose spans could not be made).
    """

    def __init__(self, settings: Settings, metrics: AnswerMetrics | None = None,
                 exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from prometheus_client import CollectorRegistry, Counter

        registry = metrics.registry if metrics is not None else CollectorRegistry()
        if registry not in _COUNTERS:  # one set per registry: tracers sharing metrics share counts
            _COUNTERS[registry] = (
                Counter("ragbudget_trace_spans_exported", "Answer spans the trace exporter accepted",
                        registry=registry),
                Counter("ragbudget_trace_export_failures", "Answer spans the trace exporter failed "
                        "to send (logged; the answers were not affected)", registry=registry),
                Counter("ragbudget_trace_build_failures", "Answers whose spans could not be made "
                        "(logged; the answers were not affected)", registry=registry))
        self.exported, self.failures, self.build_failures = _COUNTERS[registry]
        self.settings = settings
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint,
                                        headers=_headers(settings.otlp_headers) or None)
        resource = Resource.create({"service.name": settings.otlp_service_name,
                                    "openinference.project.name": settings.otlp_service_name})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(_CountingExporter(exporter, self)))  # type: ignore[arg-type]
        self.tracer = self.provider.get_tracer("ragbudget")

    def export(self, p: Prepared, params: GenParams, summary: Answer, identity: dict[str, Any]) -> None:
        """Queue ``summary``'s spans for export; never raises (a failure is logged and counted)."""
        try:
            url = receipt_url(self.settings, summary.receipt_id) if summary.receipt_id else None
            specs = answer_spans(p, params, summary, identity,
                                 export_text=self.settings.otlp_export_text, console_url=url)
            # The arrival on the wall clock: now minus the perf_counter time since arrival.
            arrival_ns = time.time_ns() - int((time.perf_counter() - p.arrival_t) * 1e9)
            self.emit(specs, arrival_ns)
        except Exception:
            log.exception("could not make the answer's trace spans")
            self.build_failures.inc()

    def emit(self, specs: Sequence[SpanSpec], arrival_ns: int) -> None:
        """Start and end each span of ``specs`` at ``arrival_ns`` + its offsets (ns since the epoch)."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        spans: list[Any] = []
        for s in specs:
            ctx = trace.set_span_in_context(spans[s.parent]) if s.parent is not None else None
            span = self.tracer.start_span(s.name, context=ctx, attributes=s.attributes,
                                          start_time=arrival_ns + int(s.start_ms * 1e6))
            for name, at_ms in s.events:
                span.add_event(name, timestamp=arrival_ns + int(at_ms * 1e6))
            if s.error is not None:
                span.set_status(Status(StatusCode.ERROR, s.error))
            spans.append(span)
        for s, span in reversed(list(zip(specs, spans, strict=True))):
            span.end(end_time=arrival_ns + int(s.end_ms * 1e6))

    def flush(self, timeout_ms: int = 30_000) -> bool:
        """Send every queued span now; True when all went within ``timeout_ms``."""
        return bool(self.provider.force_flush(timeout_ms))

    def shutdown(self) -> None:
        """Flush and stop the exporter thread."""
        self.provider.shutdown()


class _CountingExporter:
    """A span exporter around another that counts what it sent and what failed, and never raises."""

    def __init__(self, inner: Any, owner: AnswerTracer) -> None:
        self.inner, self.owner = inner, owner

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self.inner.export(spans)
        except Exception:
            log.exception("trace export failed")
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self.owner.exported.inc(len(spans))
        else:
            log.warning("trace export failed: %d spans dropped", len(spans))
            self.owner.failures.inc(len(spans))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(getattr(self.inner, "force_flush", lambda *_: True)(timeout_millis))


def answer_tracer(settings: Settings, metrics: AnswerMetrics | None = None) -> AnswerTracer | None:
    """The pipeline's tracer: None when ``otlp_endpoint`` is empty (nothing imported, nothing
    exported), else an :class:`AnswerTracer` to it.

    Raises:
        InvalidConfig: tracing is on but the ``tracing`` extra (opentelemetry-sdk,
            opentelemetry-exporter-otlp-proto-http) is not installed.
    """
    if not settings.otlp_endpoint:
        return None
    try:
        return AnswerTracer(settings, metrics)
    except ImportError as exc:
        from foundation.errors import InvalidConfig

        raise InvalidConfig(f"otlp_endpoint is set but OpenTelemetry is missing ({exc}); install the "
                            "tracing extra: pip install 'ragbudget[tracing]'") from exc
