"""Prometheus metrics for answers (text exposition format at ``GET /metrics``).

Histograms of TTFT, TPOT, queue and retrieval time (ms); counters of answers by
status, budget misses (measured TTFT > budget), prompt tokens (total, cached,
computed) and output tokens. One registry per :class:`AnswerMetrics` so tests and apps stay apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

if TYPE_CHECKING:
    from app.answer_types import Answer

# Buckets in ms: 1 ms .. 60 s, roughly x2 apart.
MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000,
              10000, 20000, 60000)


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
        self.answers = Counter("ragbudget_answers", "Answers by status", ["status"], registry=r)
        self.budget_misses = Counter("ragbudget_budget_misses",
                                     "Answers whose measured TTFT exceeded the budget", registry=r)
        self.tokens = Counter("ragbudget_prompt_tokens", "Prompt tokens by kind (total, cached, computed)",
                              ["kind"], registry=r)
        self.output_tokens = Counter("ragbudget_output_tokens", "Generated (output) tokens",
                                     registry=r)

    def observe(self, answer: Answer) -> None:
        """Record one finished :class:`~app.answer_types.Answer`."""
        self.answers.labels(status=answer.status).inc()
        t = answer.timings
        for hist, value in ((self.ttft, t.ttft_ms), (self.tpot, t.tpot_ms),
                            (self.queue, t.queue_ms), (self.retrieval, t.retrieval_ms)):
            if value is not None:
                hist.observe(float(value))
        if answer.within_budget is False:  # set by the pipeline; None = no first token
            self.budget_misses.inc()
        tok = answer.tokens
        for kind, count in (("prompt", tok.prompt), ("cached", tok.cached), ("computed", tok.computed)):
            self.tokens.labels(kind=kind).inc(count)
        self.output_tokens.inc(tok.output)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
