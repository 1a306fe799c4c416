"""What an answer leaves behind: its :class:`app.answering.types.Answer` summary, its receipt and
its journal row.

One :class:`AnswerReceipts` per :class:`app.answering.pipeline.AnswerPipeline`. When an answer ends (ok,
cancelled or failed once the pipeline started), :meth:`AnswerReceipts.finish` computes its
timings from the :class:`app.answering.state.InFlight` clock readings (definitions in
:mod:`app.answering.pipeline`), feeds the measured prefill to the online correction
(:meth:`app.answering.bands.PlanBands.learn`), appends exactly one receipt to the chain
(:func:`receipts.chain.append_receipt`, body from :func:`receipts.schema.build_receipt_body`)
and records the metrics. Before the first token :meth:`AnswerReceipts.open_journal` writes the
journal row (:mod:`receipts.journal`) that the receipt's append deletes, so a process killed
mid-answer still leaves a receipt (``interrupted``) at the next start.

When the append fails because the database is away (an outage, a failover, a dropped
connection), the finished receipt is spooled durably to the data directory
(:mod:`receipts.spool`) and appended by a background drain once the database is back, under
the id the answer was given; the answer's ``receipt_status`` says which happened:
``written`` (in the chain), ``pending`` (spooled; ``receipt_id`` is the id it will have) or
``failed`` (neither the chain nor the spool took it: see :meth:`AnswerReceipts.deliver`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from app.answering.bands import batch_of
from app.answering.state import InFlight, Prepared
from app.answering.types import (
    Answer,
    AnswerTimings,
    ChunkHit,
    Citation,
    FinishReason,
    PredictedTTFT,
    TokenCounts,
)
from app.prompting.conversation import Turn
from app.prompting.slots import hit_slots
from foundation.errors import Conflict, InvalidInput
from foundation.hashing import sha256_ints, sha256_text
from foundation.provenance import software_versions, utc_now_iso
from generation.base import GenParams
from receipts.spool import SPOOL_DIRNAME, DrainReport, ReceiptSpool, SpoolDrainer, content_of

if TYPE_CHECKING:
    from app.fleet import FleetEngine
    from app.metrics import AnswerMetrics
    from app.services import Services

log = logging.getLogger("ragbudget.pipeline")


class AnswerReceipts:
    """The summary, receipt and journal row of each answer of one pipeline.

    Args:
        services: the database engine (chain, journal, spool's data directory).
        metrics: where each answer and each spool drain is counted.
        engine_of: the engine an answer ran on (``AnswerPipeline.engine_of``): its generator's
            identity goes in the receipt, its bands learn the measured prefill.
    """

    def __init__(self, services: Services, metrics: AnswerMetrics,
                 engine_of: Callable[[Prepared], FleetEngine]) -> None:
        self._services = services
        self._metrics = metrics
        self._engine_of = engine_of
        self._drainer: SpoolDrainer | None = None

    @property
    def drainer(self) -> SpoolDrainer:
        """The background drain of this data directory's receipt spool (built on first use)."""
        if self._drainer is None:
            services = self._services
            self._drainer = SpoolDrainer(ReceiptSpool(services.data_dir / SPOOL_DIRNAME),
                                         lambda: services.engine, on_drained=self._drained)
        return self._drainer

    def _drained(self, report: DrainReport) -> None:
        self._metrics.spool_drained(len(report.appended), report.left)

    def finish(self, p: Prepared, params: GenParams, state: InFlight,
               receipt_id: str | None = None) -> Answer:
        """Compute timings, write the receipt, record metrics; return the :class:`Answer`.

        ``receipt_id``: the id the answer's journal row reserved (its receipt takes it and
        the row goes in the same transaction); None: a fresh id. The receipt is written or
        spooled as :meth:`deliver` says; ``summary.receipt_status`` tells which.
        """
        summary, out_ids, prefill_ms = self.summary(p, state)
        # the online correction of the engine that answered (app.fleet: one per engine)
        self._engine_of(p).bands.learn(p, state.stats, prefill_ms, (state.granted_t, state.last_t))
        try:
            engine_prompt = state.stats.engine_prompt if state.stats is not None else None
            body = self.body(p, params, summary, out_ids, engine_prompt)
        except Exception as exc:
            log.exception("the receipt body could not be built")
            summary.receipt_status, summary.receipt_error = "failed", str(exc)
        else:
            self.deliver(summary, body, receipt_id)
        self._metrics.observe(summary)
        return summary

    def deliver(self, summary: Answer, body: dict[str, Any], receipt_id: str | None) -> None:
        """Append ``body`` to the chain as ``receipt_id`` (a fresh id when None) and say on
        ``summary`` what became of it (``receipt_id``, ``receipt_status``, ``receipt_error``).

        * ``written``: appended (the journal row deleted with it).
        * ``pending``: the append failed on the database (unreachable, connection dropped,
          even after its commit) and the receipt is spooled durably under the id it will
          have (:meth:`receipts.spool.ReceiptSpool.put`; ``extra.delayed_append.reason`` in
          the receipt records why); the background drain appends it once, with backoff.
        * ``failed``: the body was refused (invalid, or its id taken), or the spool could not
          be written either (disk full, read-only). ``receipt_id`` is then the journal row's
          id, under which the next start records the answer as ``interrupted`` (None when no
          row was written: no receipt will exist). Logged as an error.
        """
        from receipts.chain import append_receipt, new_receipt_id

        rid = receipt_id or new_receipt_id()
        try:
            summary.receipt_id = str(append_receipt(self._services.engine, body,
                                                    receipt_id=rid).id)
            summary.receipt_status = "written"
            return
        except (InvalidInput, Conflict) as exc:
            if isinstance(exc, Conflict) and not exc.details.get("receipt_id"):
                return self._spool(summary, body, rid, receipt_id, str(exc))  # contention: later
            # the body is invalid or its id is taken: spooling would not help
            log.exception("receipt %s refused", rid)
            summary.receipt_id, summary.receipt_status = receipt_id, "failed"
            summary.receipt_error = str(exc)
            return
        except Exception as exc:  # the database is away: spool
            reason = (str(getattr(exc, "orig", None) or exc).strip().splitlines()
                      or [type(exc).__name__])[0][:300]
        self._spool(summary, body, rid, receipt_id, reason)

    def _spool(self, summary: Answer, body: dict[str, Any], rid: str, reserved: str | None,
               reason: str) -> None:
        """Spool ``body`` as ``rid`` for the background drain (see :meth:`deliver`); ``reserved``:
        the journal row's id (None: no row), reported when the spool fails too."""
        content = content_of(body)
        content["extra"] = {**(content.get("extra") or {}), "delayed_append": {"reason": reason}}
        try:
            self.drainer.spool.put(rid, content, created_at=utc_now_iso())
        except Exception as exc:
            log.error("receipt %s could not be written (%s) nor spooled (%s); the answer's output "
                      "has no receipt", rid, reason, exc)
            summary.receipt_id, summary.receipt_status = reserved, "failed"
            summary.receipt_error = (f"the receipt could not be written ({reason}) nor spooled "
                                     f"({exc})" + (f"; the next start records the answer as "
                                                   f"interrupted under {reserved}" if reserved else ""))
            return
        log.warning("receipt %s spooled: the database could not take it (%s)", rid, reason)
        summary.receipt_id, summary.receipt_status = rid, "pending"
        summary.receipt_error = (f"the database could not take the receipt ({reason}); it is "
                                 f"spooled and will be appended as {rid}")
        self.drainer.kick()

    def summary(self, p: Prepared, state: InFlight) -> tuple[Answer, list[int], float | None]:
        """The :class:`Answer` for ``state`` as it stands (no side effects), the output token ids
        and the measured prefill (ms, None before a first token)."""
        stats = state.stats
        first_t, last_t = state.first_t, state.last_t
        ttft_ms = (first_t - p.arrival_t) * 1000.0 if first_t is not None else None
        out_ids = list(stats.output_token_ids) if stats is not None else []
        if state.stop is not None and state.ids_per_event:
            out_ids = out_ids[:state.n]  # tokens a backend made past the stop were never shown
        n_out = len(out_ids) if out_ids else state.n
        tpot_ms = ((last_t - first_t) * 1000.0 / (n_out - 1)
                   if first_t is not None and last_t is not None and n_out > 1 else None)
        text = "".join(state.text)
        prompt_tokens = p.prompt.prompt_tokens
        cached_tokens = int(stats.cached_tokens or 0) if stats is not None else 0
        k = p.plan.chosen_k if p.plan.chosen_k is not None else 0
        row = p.plan.rows[k] if p.plan.rows and k < len(p.plan.rows) else None
        prefill_ms = ((first_t - state.granted_t) * 1000.0
                      if first_t is not None and state.granted_t is not None else None)
        spent_ms = ((state.granted_t - p.arrival_t) * 1000.0 if state.granted_t is not None else None)
        within = None if ttft_ms is None else bool(ttft_ms <= p.budget_ms)
        corr = p.correction
        summary = Answer(
            status=state.status, error=state.error, text=text,
            question=p.request.question, ttft_budget_ms=p.budget_ms,
            # measured TTFT <= budget; None when no token came (nothing to measure).
            within_budget=within,
            budget_miss_cause=(_miss_cause(p, row, spent_ms, state.queue_ms, prefill_ms) if within is False
                               else None),
            revision=p.retrieval.revision, chosen_k=k, binding=p.plan.binding,
            # predicted TTFT = measured pre-prefill overhead + the profile's prefill p50/p95,
            # the same quantity as the measured ttft_ms (arrival to first token).
            predicted=PredictedTTFT(
                ttft_p50_ms=row.ttft_p50_ms + p.plan.overhead_ms if row else None,
                ttft_p95_ms=row.ttft_p95_ms + p.plan.overhead_ms if row else None,
                prefill_p50_ms=row.ttft_p50_ms if row else None,
                overhead_ms=p.plan.overhead_ms, profile_id=p.profile.id,
                profile_source=p.profile.source, wait_ms=p.predicted_wait_ms,
                late_bound=p.late_bound,
                correction_factor=corr.factor if corr is not None else None,
                p95_multiplier=corr.p95_multiplier if corr is not None else None,
                machine_speed=corr.speed if corr is not None else None,
                correction_group=corr.group if corr is not None else None,
                batch=batch_of(p.planner_profile), engine_id=p.engine_id,
                cached_tokens_per_k=[r.cached_tokens for r in p.plan.rows] or None,
                computed_tokens_per_k=[r.computed_tokens for r in p.plan.rows] or None),
            timings=AnswerTimings(
                queue_ms=state.queue_ms, ttft_ms=ttft_ms, tpot_ms=tpot_ms,
                retrieval_ms=p.timings_ms.get("retrieval_ms"),
                overhead_ms=p.timings_ms.get("overhead_ms"),
                total_ms=(time.perf_counter() - p.arrival_t) * 1000.0,
                auth_ms=p.timings_ms.get("auth_ms"), planning_ms=p.timings_ms.get("planning_ms"),
                prefill_ms=prefill_ms),
            tokens=TokenCounts(prompt=prompt_tokens, cached=cached_tokens,
                               computed=prompt_tokens - cached_tokens, output=n_out),
            citations=Citation.of_hits(p.retrieval.hits, k, p.prompt.order),
            receipt_id=None, receipt_status="failed",  # until deliver() says otherwise
            finish_reason=_finish_reason(state, p.max_new_tokens, n_out), stop_sequence=state.stop,
        )
        return summary, out_ids, prefill_ms

    def open_journal(self, p: Prepared, params: GenParams, state: InFlight) -> str | None:
        """Write the answer's journal row before its first token (:mod:`receipts.journal`): the
        receipt body as known now (status ``interrupted``, no output, timings up to the model
        grant), so a process killed mid-answer still leaves a receipt, written at the next
        start. Returns the receipt id it reserved; None when the write failed (logged; the
        answer goes on, and its receipt is still written when it ends)."""
        from receipts.chain import new_receipt_id
        from receipts.journal import open_entry

        try:
            summary, _ids, _prefill = self.summary(p, state)
            summary.status = "interrupted"
            summary.timings.total_ms = None  # not known: the answer has not ended
            body = self.body(p, params, summary, [], with_output=False)
            receipt_id = new_receipt_id()
            open_entry(self._services.engine, receipt_id, body)
        except Exception:
            log.exception("could not write the answer's journal row; a crash now would lose its receipt")
            return None
        return receipt_id

    def body(self, p: Prepared, params: GenParams, summary: Answer, out_ids: list[int],
             engine_prompt: dict[str, Any] | None = None, *,
             with_output: bool = True) -> dict[str, Any]:
        """The receipt body of ``summary`` (validated; ``output`` null unless ``with_output``)."""
        from receipts.schema import build_receipt_body

        gen = self._engine_of(p).generator
        r = p.retrieval
        ident = dict(gen.identity)
        text = summary.text
        return build_receipt_body(
            question=p.request.question,
            corpus={"revision": r.revision, "root_hash": r.root_hash},
            embedder={"id": r.embedder_id, "identity": r.embedder},
            request={"messages": [t.record() for t in p.request.history]
                     + [Turn("user", p.request.question, p.request.question_name).record()],
                     "user": p.request.user},
            retrieval={"k_candidates": r.k, "index": r.index, "query_truncated": r.query_truncated,
                       "query": p.query},
            # each candidate's prompt slot (app.prompting.slots): what replay lays the prompt out from
            candidates=[ChunkHit(**ChunkHit.fields_of(h)).receipt_candidate(slot)
                        for h, slot in zip(r.hits, hit_slots(r.hits), strict=True)],
            plan={"budget_ms": p.budget_ms, "chosen_k": summary.chosen_k,
                  "binding": p.plan.binding,
                  "predicted_ttft_p50_ms": summary.predicted.ttft_p50_ms,
                  "predicted_ttft_p95_ms": summary.predicted.ttft_p95_ms,
                  "profile_id": p.profile.id, "profile_source": p.profile.source,
                  "overhead_ms": p.timings_ms.get("overhead_ms"),
                  "scaffold_cached": p.scaffold_cached, "rows": p.plan.to_dict().get("rows", []),
                  "predicted_wait_ms": p.predicted_wait_ms, "late_bound": p.late_bound,
                  "correction": p.correction.to_dict() if p.correction is not None else None,
                  # the engine routed to, and every engine's prediction on arrival (latency_model.fleet)
                  "engine_id": p.engine_id,
                  **({"fleet": p.fleet} if p.fleet is not None else {})},
            scaffold={"id": p.scaffold.id, "name": p.scaffold.name, "hash": p.scaffold.hash},
            prompt={"token_ids_hash": p.prompt.prompt_hash, "prompt_tokens": summary.tokens.prompt,
                    "cached_tokens": summary.tokens.cached,
                    "computed_tokens": summary.tokens.computed,
                    # the order the chosen slots were shown in (app.prompting.layout); replay lays them out so
                    "layout": {"name": p.prompt.layout, "slots": list(p.prompt.order)},
                    # a follow-up's layout: the earlier turn continued, or why text (app.answering.followup)
                    **({"conversation": p.conversation} if p.conversation is not None else {})},
            generator={"engine_id": p.engine_id,
                       "backend": ident.get("backend"), "model_id": ident.get("model_id"),
                       "weights_hash": ident.get("weights_hash"), "dtype": ident.get("dtype"),
                       "device": ident.get("device"),
                       "params": {**params.to_dict(), "stop": list(p.request.stop)},
                       "chat_template": ident.get("chat_template"),
                       # the local engine's prefill chunking, which replay reuses
                       **({"engine": ident["engine"]} if ident.get("engine") else {})},
            timings=summary.timings.model_dump(),
            output=({"text": text, "text_hash": sha256_text(text),
                     "token_ids": out_ids, "token_ids_hash": sha256_ints(out_ids),
                     "output_tokens": summary.tokens.output, "finish_reason": summary.finish_reason,
                     "stop_sequence": summary.stop_sequence} if with_output else None),
            status=summary.status,
            error=summary.error.model_dump() if summary.error is not None else None,
            software=software_versions(),
            **({"extra": {"engine_prompt": engine_prompt}} if engine_prompt else {}),
        )


def _miss_cause(p: Prepared, row: Any, spent_ms: float | None, queue_ms: float | None,
                prefill_ms: float | None = None) -> str:
    """Why a measured TTFT went over budget, ms in, one word out.

    The overrun (TTFT - budget) is the sum of two parts: ``late`` = ``spent_ms`` (arrival to
    model granted) + the chosen row's planned prefill p95 - budget (how far the plan was
    already over when the model was free), and ``prefill_ms`` - that p95 (how far the prefill
    ran past its prediction). ``prefill`` (misprediction) when the plan still fitted once the
    model was free (``late <= 0``) or the prefill's part is the larger; else what ate the
    budget before prefill: ``queue`` (the wait for the model was the larger part of
    ``spent_ms``) or ``overhead`` (auth, parsing, retrieval, planning). ``overhead`` when
    ``spent_ms`` or ``row`` is unknown."""
    if spent_ms is None or row is None:
        return "overhead"
    late = spent_ms + row.ttft_p95_ms - p.budget_ms
    if late <= 0 or (prefill_ms is not None and prefill_ms - row.ttft_p95_ms >= late):
        return "prefill"
    q = queue_ms or 0.0
    return "queue" if q >= spent_ms - q else "overhead"


def _finish_reason(state: InFlight, max_new_tokens: int, n_out: int) -> FinishReason:
    """Why generation ended: ``stop`` (a stop string or the end of sequence), ``length``,
    ``cancelled`` or ``error``."""
    if state.stop is not None:
        return "stop"
    if state.status == "cancelled":
        return "cancelled"
    if state.status == "failed":
        return "error"
    reason = state.stats.finish_reason if state.stats is not None else None
    if reason == "stop" or reason == "length":
        return reason
    return "length" if n_out >= max_new_tokens else "stop"
