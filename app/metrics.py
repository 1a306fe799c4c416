"""Prometheus metrics for answers (text exposition format at ``GET /metrics``).

Histograms of TTFT, TPOT, queue, retrieval, auth, planning and prefill time
and of the predicted wait (ms); counters of answers by status, budget misses
(measured TTFT > budget, also by cause), receipts by outcome (written, pending, failed) and
spooled receipts appended later, fast rejections, prompt tokens (total,
cached, computed) and output tokens; gauges of the queue depth and of the
online correction (factor, p95 multiplier, coverage); per configured engine (``engine`` label,
:mod:`app.fleet`): answers by status, whether it is in rotation, its predicted wait at the
latest arrival and the answers retried elsewhere after it failed before a first token; per
local engine, its prefix KV cache (lookups, hits, cached tokens, blocks stored and evicted,
blocks and bytes held, the budget), read from the cache when ``/metrics`` is scraped
(:meth:`AnswerMetrics.prefix_cache_state`). One
registry per
:class:`AnswerMetrics` so tests and apps stay apart.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from app.answering.types import Answer
    from generation.engine.kv_cache import PrefixCacheStats

#: The prefix cache's counters (:class:`generation.engine.kv_cache.PrefixCacheStats` field,
#: metric name without ``_total``, help), each a Prometheus counter per engine.
PREFIX_CACHE_COUNTERS = (
    ("lookups", "ragbudget_prefix_cache_lookups", "Answers admitted that asked the prefix KV cache"),
    ("hits", "ragbudget_prefix_cache_hits", "Answers admitted that loaded at least one cached block"),
    ("cached_tokens", "ragbudget_prefix_cache_tokens",
     "Prompt tokens loaded from the prefix KV cache instead of computed"),
    ("stored", "ragbudget_prefix_cache_blocks_stored", "Token blocks stored in the prefix KV cache"),
    ("evicted", "ragbudget_prefix_cache_blocks_evicted",
     "Token blocks evicted from the prefix KV cache (least recently used leaf first)"),
    ("warm_tokens", "ragbudget_prefix_cache_warm_tokens",
     "Tokens the local engine prefilled into the prefix KV cache while idle (finished turns' tails)"),
)
#: The prefix cache's gauges (field, metric name, help), per engine.
PREFIX_CACHE_GAUGES = (
    ("blocks", "ragbudget_prefix_cache_blocks", "Token blocks held in the prefix KV cache now"),
    ("bytes", "ragbudget_prefix_cache_bytes", "Bytes of K/V and logits held in the prefix KV cache now"),
    ("budget_bytes", "ragbudget_prefix_cache_budget_bytes",
     "The prefix KV cache's memory budget (RAGBUDGET_GENERATOR_PREFIX_CACHE_MIB), bytes"),
)


class PrefixCacheCollector(Collector):
    """Exposes the last :class:`PrefixCacheStats` given per engine (label ``engine``): the
    cache keeps its own counts, so they are read at scrape time, not mirrored by increments."""

    def __init__(self) -> None:
        self._stats: dict[str, PrefixCacheStats] = {}
        self._lock = threading.Lock()

    def set(self, stats: Mapping[str, PrefixCacheStats]) -> None:
        """Replace the snapshot: engine id -> its cache's counters now."""
        with self._lock:
            self._stats = dict(stats)

    def collect(self) -> Iterator[Metric]:
        """One family per counter and gauge, a sample per engine (none before :meth:`set`)."""
        with self._lock:
            stats = dict(self._stats)
        for field, name, doc in PREFIX_CACHE_COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["engine"])
            for engine, st in stats.items():
                counter.add_metric([engine], float(getattr(st, field)))
            yield counter
        for field, name, doc in PREFIX_CACHE_GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["engine"])
            for engine, st in stats.items():
                gauge.add_metric([engine], float(getattr(st, field)))
            yield gauge

# Buckets in ms: 1 ms .. 60 s, roughly x2 apart.
MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000,
              10000, 20000, 60000)
# The key check is microseconds to a millisecond (app.auth); finer buckets, ms.
AUTH_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 50, 100)


class AnswerMetrics:
    """The answer metrics of one app instance."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("ragbudget_ttft_ms", "Time to first token (ms), queue included",
                              buckets=MS_BUCKETS, registry=r)
        self.tpot = Histogram("ragbudget_tpot_ms", "Mean time per output token after the first (ms)",
                              buckets=MS_BUCKETS, registry=r)
        self.queue = Histogram("ragbudget_queue_ms", "Wait for the model (ms)",
                               buckets=MS_BUCKETS, registry=r)
        self.retrieval = Histogram("ragbudget_retrieval_ms", "Retrieval time (ms)",
                                   buckets=MS_BUCKETS, registry=r)
        self.auth = Histogram("ragbudget_auth_ms", "API key check (ms), inside TTFT",
                              buckets=AUTH_BUCKETS, registry=r)
        self.planning = Histogram("ragbudget_planning_ms", "Prompt building and planning (ms)",
                                  buckets=MS_BUCKETS, registry=r)
        self.prefill = Histogram("ragbudget_prefill_ms", "Model granted to first token (ms)",
                                 buckets=MS_BUCKETS, registry=r)
        self.answers = Counter("ragbudget_answers", "Answers by status", ["status"], registry=r)
        self.receipts = Counter("ragbudget_answer_receipts", "Answers by what became of their "
                                "receipt at the answer's end: written, pending (spooled while the "
                                "database is away) or failed (no receipt with the output)",
                                ["status"], registry=r)
        self.spool_appended = Counter("ragbudget_spooled_receipts_appended", "Spooled receipts "
                                      "appended to the chain once the database was back", registry=r)
        self.spool_waiting = Gauge("ragbudget_spooled_receipts_waiting", "Spooled receipts left "
                                   "after the latest drain pass", registry=r)
        self.budget_misses = Counter("ragbudget_budget_misses",
                                     "Answers whose measured TTFT exceeded the budget", registry=r)
        self.tokens = Counter("ragbudget_prompt_tokens", "Prompt tokens by kind (total, cached, computed)",
                              ["kind"], registry=r)
        self.output_tokens = Counter("ragbudget_output_tokens", "Generated (output) tokens",
                                     registry=r)
        self.misses_by_cause = Counter(
            "ragbudget_budget_misses_by_cause", "Budget misses by cause: queue (the wait), prefill "
            "(misprediction), overhead (auth, parsing, retrieval, planning)", ["cause"], registry=r)
        self.rejections = Counter(
            "ragbudget_budget_rejections", "Requests refused fast (503 budget_unreachable), by where: "
            "arrival (predicted wait) or granted (after the wait)", ["where"], registry=r)
        self.queue_depth = Gauge("ragbudget_queue_depth", "Requests waiting for the model at the "
                                 "latest arrival", registry=r)
        self.predicted_wait = Histogram("ragbudget_predicted_wait_ms", "Predicted wait for the model "
                                        "on arrival (ms)", buckets=MS_BUCKETS, registry=r)
        self.correction_factor = Gauge("ragbudget_correction_factor", "Online correction factor of "
                                       "the prefill prediction", registry=r)
        self.correction_p95_multiplier = Gauge("ragbudget_correction_p95_multiplier", "Conformal "
                                               "p95/p50 multiplier (0: not yet)", registry=r)
        self.machine_speed = Gauge("ragbudget_machine_speed", "Engine step time measured over "
                                   "predicted by the step model, median of the latest steps "
                                   "(1: as at calibration)", registry=r)
        self.prefill_coverage = Gauge("ragbudget_prefill_p95_coverage", "Share of the correction "
                                      "window's measured prefills within their predicted p95",
                                      registry=r)

        self.engine_answers = Counter("ragbudget_engine_answers", "Answers by the engine that "
                                      "answered them and status", ["engine", "status"], registry=r)
        self.engine_up = Gauge("ragbudget_engine_up", "1 while the engine is in rotation, 0 while it "
                               "is out (refused connections; probed until it answers)", ["engine"],
                               registry=r)
        self.engine_wait = Gauge("ragbudget_engine_predicted_wait_ms", "The engine's predicted wait "
                                 "at the latest arrival, its other clients' load included (ms)",
                                 ["engine"], registry=r)
        self.engine_retries = Counter("ragbudget_engine_retries", "Answers whose stream died before "
                                      "its first token on this engine and were retried on another",
                                      ["engine"], registry=r)
        self._prefix_cache = PrefixCacheCollector()
        r.register(self._prefix_cache)

    def engine_state(self, engine_id: str, up: bool, predicted_wait_ms: float | None) -> None:
        """Record one engine as an arriving answer saw it: in rotation or not, and its predicted
        wait (ms; None: not planned, e.g. out of rotation)."""
        self.engine_up.labels(engine=engine_id).set(1.0 if up else 0.0)
        if predicted_wait_ms is not None:
            self.engine_wait.labels(engine=engine_id).set(predicted_wait_ms)

    def observe(self, answer: Answer) -> None:
        """Record one finished :class:`~app.answering.types.Answer`."""
        self.answers.labels(status=answer.status).inc()
        if answer.predicted.engine_id is not None:
            self.engine_answers.labels(engine=answer.predicted.engine_id, status=answer.status).inc()
        self.receipts.labels(status=answer.receipt_status).inc()
        t = answer.timings
        for hist, value in ((self.ttft, t.ttft_ms), (self.tpot, t.tpot_ms),
                            (self.queue, t.queue_ms), (self.retrieval, t.retrieval_ms),
                            (self.auth, t.auth_ms), (self.planning, t.planning_ms),
                            (self.prefill, t.prefill_ms)):
            if value is not None:
                hist.observe(float(value))
        if answer.within_budget is False:  # set by the pipeline; None = no first token
            self.budget_misses.inc()
            self.misses_by_cause.labels(cause=answer.budget_miss_cause or "overhead").inc()
        tok = answer.tokens
        for kind, count in (("prompt", tok.prompt), ("cached", tok.cached), ("computed", tok.computed)):
            self.tokens.labels(kind=kind).inc(count)
        self.output_tokens.inc(tok.output)

    def spool_drained(self, appended: int, left: int) -> None:
        """Record one drain pass of the receipt spool: ``appended`` receipts, ``left`` waiting."""
        self.spool_appended.inc(appended)
        self.spool_waiting.set(left)

    def queue_state(self, depth: int, predicted_wait_ms: float) -> None:
        """Record the queue seen by an arriving answer: depth and predicted wait (ms)."""
        self.queue_depth.set(depth)
        self.predicted_wait.observe(predicted_wait_ms)

    def correction(self, factor: float, p95_multiplier: float | None, coverage: float | None,
                   speed: float | None = None) -> None:
        """Record the online correction after an answer fed it (``speed``: the machine speed
        from the engine's steps it was scaled to, None when not read)."""
        self.correction_factor.set(factor)
        if speed is not None:
            self.machine_speed.set(speed)
        self.correction_p95_multiplier.set(p95_multiplier or 0.0)
        if coverage is not None:
            self.prefill_coverage.set(coverage)

    def prefix_cache_state(self, stats: Mapping[str, PrefixCacheStats]) -> None:
        """Record each local engine's prefix KV cache counters (engine id -> stats, as
        :meth:`generation.engine.kv_cache.BlockPrefixCache.stats` returns them), shown by the
        next :meth:`render`; engines absent from ``stats`` are dropped."""
        self._prefix_cache.set(stats)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
