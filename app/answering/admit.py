"""Admitting an answer: everything before it has the model, and again when it gets it.

Validate the request, retrieve K candidates, plan every engine in rotation and route the
answer to the engine and k that carry the most context within its budget
(:func:`latency_model.fleet.choose`, :meth:`AdmitSteps.prepare`); refuse what cannot fit (the
context window, :mod:`app.answering.window`; with ``on_budget_miss: reject``, a budget even
k = 0 misses, :meth:`AdmitSteps._check_reachable`); choose k again when the model is free
(late binding, :meth:`AdmitSteps.bind`); move an answer whose engine died before its first
token to another engine (:meth:`AdmitSteps._elsewhere`). Retrieve and plan without
generating: :meth:`AdmitSteps.advise`.

:class:`AdmitSteps` is the admission half of :class:`app.answering.pipeline.AnswerPipeline`;
what it reads of the pipeline is declared on it. Timing definitions:
:mod:`app.answering.pipeline`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from app.answering.arrivals import Arrivals
from app.answering.followup import conversation_record, find_earlier_turn, fits_window
from app.answering.generate import granted_t, start
from app.answering.genqueue import Cancelled, Ticket
from app.answering.kv_lookup import cached_per_k
from app.answering.state import AnswerRequest, AnswerSwitches, InFlight, Prepared
from app.answering.types import Advice, AdviceTimings, Citation, PlanPublic, ProfileRef
from app.answering.window import fit_window, refuse_output_over_window
from app.fleet import FleetEngine
from app.metrics import AnswerMetrics
from app.prompting.conversation import check_roles, retrieval_query
from app.services import Services
from app.validation import (
    check_budget,
    check_k,
    check_max_new_tokens,
    check_on_budget_miss,
    check_question,
)
from foundation.errors import BudgetUnreachable, RagBudgetError
from generation.base import GenParams, TokenStream
from latency_model.fleet import EngineView, FleetChoice, choose
from latency_model.planner import Plan, PrefillBand, chunking_prefix
from latency_model.profile import Profile

if TYPE_CHECKING:
    from app.models import Scaffold
    from app.prompting.conversation import EarlierTurn
    from app.prompting.prompt import Prompt, PromptBuilder, PromptChunk
    from retrieval.retriever import Hit

#: An answer moved to another engine (:meth:`AdmitSteps._elsewhere`): ``(prepared, engine,
#: entered slot, stream, refusal, ticket)``.
Moved = tuple[Prepared, FleetEngine, Any, TokenStream | None, Exception | None, Ticket]

log = logging.getLogger("ragbudget.pipeline")


class AdmitSteps:
    """The admission half of the answer pipeline (see the module docstring).

    Reads the pipeline's services, settings, switches, metrics, engines (each with its queue,
    bands and health, :mod:`app.fleet`) and arrivals, and the building blocks declared below,
    all defined by :class:`app.answering.pipeline.AnswerPipeline`.
    """

    services: Services
    settings: Any  # app.settings.Settings
    switches: AnswerSwitches
    metrics: AnswerMetrics
    engines: dict[str, FleetEngine]
    arrivals: Arrivals
    _round_robin: Iterator[int]

    if TYPE_CHECKING:
        def scaffold_and_builder(self) -> tuple[Scaffold, PromptBuilder]: ...
        def profile(self) -> Profile: ...
        def engine_of(self, p: Prepared) -> FleetEngine: ...
        def in_rotation(self) -> list[FleetEngine]: ...
        @staticmethod
        def prompt_chunks(hits: list[Hit]) -> list[PromptChunk]: ...
        def laid_out(self, builder: PromptBuilder, scaffold_text: str, chunks: list[PromptChunk],
                     question: str, history: Any, *, earlier: EarlierTurn | None = None) -> Prompt: ...

    def prepare(self, req: AnswerRequest, arrival_t: float | None = None,
                auth_ms: float | None = None) -> Prepared:
        """Validate, retrieve K candidates, plan k for the budget, build the prompt.

        ``arrival_t``: the request's arrival (``perf_counter`` seconds; default now);
        everything since counts against the budget. ``auth_ms``: the key check's
        duration, already inside that time, reported apart. With late binding the
        plan's overhead is the time spent plus the queue's predicted wait; the k it
        picks is provisional (:meth:`bind` picks again when the model is free).

        Raises:
            InvalidInput: empty/over-long question, bad budget, k_max, max_new_tokens,
                on_budget_miss, or sampling parameters outside their ranges
                (``invalid_sampling_parameter``, :meth:`GenParams.validate`).
            ContextLengthExceeded: the prompt without a chunk fills the context window, or
                ``max_new_tokens`` asked for does not fit beside it (:func:`app.answering.window.fit_window`).
            UnknownRevision: ``req.revision`` does not exist.
        """
        arrival_t = arrival_t if arrival_t is not None else time.perf_counter()
        s = self.settings
        question = check_question(s, req.question)
        budget = check_budget(s, req.ttft_budget_ms)
        refuse_output_over_window(
            req.max_new_tokens, lambda: max(int(e.generator.context_window) for e in self.in_rotation()))
        max_new = check_max_new_tokens(s, req.max_new_tokens)
        self.gen_params(req, max_new)  # refused here, before retrieval and before the queue
        k_cap = check_k(s, req.k_max, s.retrieval_candidates)
        check_on_budget_miss(req.on_budget_miss)
        check_roles(req.history)
        query = retrieval_query(question, req.history)
        t0 = time.perf_counter()
        result = self.services.retriever.retrieve(query, k_cap, req.revision)
        t1 = time.perf_counter()
        scaffold, builder = self.scaffold_and_builder()
        engines = self.in_rotation()
        window = max(int(e.generator.context_window) for e in engines)
        # A follow-up that continues its earlier turn token for token (app.answering.followup)
        earlier, fallback = (find_earlier_turn(
            self.services, list(req.history), scaffold,
            {str(e.generator.identity.get("model_id")) for e in engines})
            if self.switches.follow_up_layout == "earlier_turn" else (None, "text_layout_set"))
        full = builder.candidates(scaffold.text, self.prompt_chunks(result.hits), question, req.history,
                                  layout=self.switches.prompt_layout, earlier=earlier)
        if earlier is not None and not fits_window(full, max_new, window):
            # the earlier turn's exact tokens go first (text turns), before any new chunk
            fallback = "window"
            full = builder.candidates(scaffold.text, self.prompt_chunks(result.hits), question,
                                      req.history, layout=self.switches.prompt_layout)
        max_new = fit_window(full.prompt_tokens_for(0), max_new, req.max_new_tokens is None, window)
        looks = self._look(engines, full)
        overhead_ms = (time.perf_counter() - arrival_t) * 1000.0
        views = [EngineView(e.id, look["planner_profile"],
                            look["wait_ms"] if self.switches.late_binding else 0.0,
                            int(e.generator.context_window), scaffold_cached=look["cached"],
                            in_flight=e.in_flight(), cached_tokens=look["cached_k"])
                 for e, look in looks]
        choice = self._choose(views, full, budget, max_new, overhead_ms)
        if self.switches.routing == "joint":
            engine_id, plan = self._target(choice, views, full, budget, max_new, overhead_ms, looks)
        else:
            engine_id, plan = self._baseline(views, full, budget, max_new, overhead_ms)
        look = dict(looks)[self.engines[engine_id]]
        profile, planner_profile, correction = look["profile"], look["planner_profile"], look["correction"]
        cached, wait_ms, depth = look["cached"], look["wait_ms"], look["depth"]
        k = plan.chosen_k if plan.chosen_k is not None else 0
        prompt = self.laid_out(builder, scaffold.text, self.prompt_chunks(result.hits)[:k], question,
                               req.history, earlier=full.earlier)
        t2 = time.perf_counter()
        if question != req.question:
            req = replace(req, question=question)
        return Prepared(
            request=req, budget_ms=budget, max_new_tokens=max_new, retrieval=result, plan=plan,
            prompt=prompt, full_prompt=full, profile=profile, scaffold=scaffold,
            scaffold_cached=cached, query=query, arrival_t=arrival_t, prepared_t=t2,
            timings_ms={"retrieval_ms": (t1 - t0) * 1000.0, "planning_ms": (t2 - t1) * 1000.0,
                        "overhead_ms": overhead_ms,
                        **({"auth_ms": auth_ms} if auth_ms is not None else {})},
            predicted_wait_ms=wait_ms, queue_depth=depth, planner_profile=planner_profile,
            correction=correction, engine_id=engine_id, fleet=choice.to_dict(),
            conversation=conversation_record(full, list(req.history), fallback),
        )

    def _look(self, engines: list[FleetEngine], full: Prompt) -> list[tuple[FleetEngine, dict[str, Any]]]:
        """What the planner needs of each engine now: its profile, planning band and correction
        (:meth:`PlanBands.planner_profile`), whether it caches ``full``'s scaffold and how many
        tokens of each candidate prompt it caches (:func:`app.answering.kv_lookup.cached_per_k`), its queue's
        predicted wait (other clients' load included) and depth. An engine without a profile
        (``UnknownProfile``: never calibrated, no prior possible) is left out while others
        have one; when none has, the first engine's error is raised. An engine whose queue is
        full (a new request would be refused 429) is left out while another is not."""
        out: list[tuple[FleetEngine, dict[str, Any]]] = []
        first_error: RagBudgetError | None = None
        open_ = [e for e in engines if not e.sync_slots().full()]
        for e in open_ if open_ else engines:
            try:
                profile = e.profile() if e.position else self.profile()
            except RagBudgetError as exc:
                if len(engines) == 1:
                    raise
                log.warning("engine %s left out of planning: %s", e.id, exc)
                first_error = first_error or exc
                continue
            e.sync_slots()
            e.start_load(profile)
            e.profile_id = profile.id
            planner_profile, correction = e.bands.planner_profile(profile)
            wait_ms = e.predicted_wait_ms()
            self.metrics.engine_state(e.id, True, wait_ms)
            out.append((e, {"profile": profile, "planner_profile": planner_profile,
                            "correction": correction,
                            "cached": bool(e.generator.prefix_cached(full.scaffold_ids)),
                            # what its prefix cache holds of each candidate prompt (app.answering.kv_lookup);
                            # not assumed past the scaffold while another client uses the engine
                            "cached_k": None if e.foreign_load() else cached_per_k(e.generator, full),
                            "wait_ms": wait_ms, "depth": e.queue.depth}))
        if not out:
            assert first_error is not None
            raise first_error
        return out

    def _choose(self, views: list[EngineView], full: Prompt, budget: float, max_new: int,
                overhead_ms: float) -> FleetChoice:
        """:func:`latency_model.fleet.choose` over ``views`` for ``full`` with ``overhead_ms`` spent."""
        return choose(views, question_tokens=full.question_tokens, scaffold_tokens=full.scaffold_len,
                      chunk_tokens=full.planned_chunk_tokens(), budget_ms=budget,
                      max_new_tokens=max_new, overhead_ms=overhead_ms,
                      extra_tokens=full.framing_tokens + full.history_tokens)

    def _fixed(self, plan: Plan) -> Plan:
        """``plan`` at ``fixed_k`` (capped at the candidates), binding ``fixed``, when it is set."""
        if self.switches.fixed_k is None:
            return plan
        return replace(plan, chosen_k=min(int(self.switches.fixed_k), len(plan.rows) - 1), binding="fixed")

    def _baseline(self, views: list[EngineView], full: Prompt, budget: float, max_new: int,
                  overhead_ms: float) -> tuple[str, Plan]:
        """The engine and plan of a baseline ``routing`` (benchmarks only): ``round_robin`` takes
        the engines in turn; ``least_ttft`` the one with the least predicted p95 TTFT (its wait
        plus the prefill) at ``fixed_k``; either at ``fixed_k`` when set."""
        plans = [(v, self._choose([v], full, budget, max_new, overhead_ms).plan) for v in views]
        if self.switches.routing == "round_robin":
            view, plan = plans[next(self._round_robin) % len(plans)]
        else:
            def ttft(item: tuple[EngineView, Plan | None]) -> float:
                v, pl = item
                assert pl is not None
                k = min(int(self.switches.fixed_k or 0), len(pl.rows) - 1)
                return v.predicted_wait_ms + pl.rows[k].ttft_p95_ms
            view, plan = min(plans, key=ttft)
        assert plan is not None
        return view.engine_id, self._fixed(plan)

    def _target(self, choice: FleetChoice, views: list[EngineView], full: Prompt, budget: float,
                max_new: int, overhead_ms: float,
                looks: list[tuple[FleetEngine, dict[str, Any]]]) -> tuple[str, Plan]:
        """The engine a request goes to and its plan there: the fleet's choice when something
        fits; else (nothing fits anywhere, even k = 0) the engine where k = 0 would come
        soonest at p50 after the least wait its queue may have
        (:meth:`GenerationQueue.min_wait_ms`), so a fast refusal (``on_budget_miss: reject``)
        happens only when no engine could make k = 0."""
        if choice.fits or len(views) == 1:
            assert choice.engine_id is not None and choice.plan is not None
            return choice.engine_id, choice.plan
        best: tuple[float, str, Plan] | None = None
        for view, (e, _look) in zip(views, looks, strict=True):
            alone = self._choose([view], full, budget, max_new, overhead_ms)
            assert alone.plan is not None
            rows = alone.plan.rows
            soonest = e.queue.min_wait_ms() + rows[0].ttft_p50_ms if rows else float("inf")
            if best is None or soonest < best[0]:
                best = (soonest, e.id, alone.plan)
        assert best is not None
        return best[1], best[2]

    def _plan(self, full: Prompt, cached: bool, budget: float, max_new: int,
              profile: PrefillBand, overhead_ms: float, engine: FleetEngine | None = None) -> Plan:
        """The planner over all K candidates of ``full`` on ``engine`` (default: the first) with
        ``overhead_ms`` already gone.

        Planned through the fleet planner (:func:`latency_model.fleet.choose`) with that one
        engine, whose wait is already inside ``overhead_ms``: exactly the single-engine plan
        (``tests/latency_model/test_fleet.py`` pins that). The engine's prefix cache is looked up
        now (:func:`app.answering.kv_lookup.cached_per_k`): at :meth:`bind`, the last look before admission.
        """
        e = engine or next(iter(self.engines.values()))
        view = EngineView(e.id, profile, 0.0, int(e.generator.context_window), scaffold_cached=cached,
                          cached_tokens=cached_per_k(e.generator, full))
        choice = self._choose([view], full, budget, max_new, overhead_ms)
        assert choice.plan is not None, "a healthy engine always has a plan"
        return choice.plan

    def bind(self, p: Prepared, now_t: float | None = None, arrival_key: int | None = None) -> Prepared:
        """Late binding: choose k now that the request has the model; return the updated request.

        The hook a generation queue or scheduler calls when it hands ``p`` the model:
        ``now_t`` (``perf_counter`` seconds, default now) minus ``p.arrival_t`` is the
        time already spent (auth, retrieval, queue wait); the plan gets the budget minus
        that, under the profile (and online correction) in force now, and the prompt is
        rebuilt for the chosen k. The retrieval and candidate list are those of arrival.
        The time this takes is added to ``planning_ms``. On a remote engine whose slots other
        clients hold (its ``/slots``), the wait the engine itself will add is counted too
        (:meth:`GenerationQueue.engine_wait_ms`). With ``room_for_arrivals`` the k is
        capped so the requests arrived meanwhile (all but ``arrival_key``, this request's own
        :meth:`Arrivals.arrive` key) keep room to answer (:meth:`Arrivals.room`).
        """
        t0 = time.perf_counter()
        now_t = now_t if now_t is not None else t0
        spent_ms = max((now_t - p.arrival_t) * 1000.0, 0.0)
        engine = self.engine_of(p)
        planner_profile, correction = engine.bands.planner_profile(p.profile)
        # a remote engine whose slots other clients hold keeps this request waiting there
        ahead_ms = engine.queue.engine_wait_ms()
        plan = self._plan(p.full_prompt, p.scaffold_cached, p.budget_ms, p.max_new_tokens,
                          planner_profile, spent_ms + ahead_ms, engine)
        if self.switches.fixed_k is not None:
            plan = self._fixed(plan)
        elif self.switches.room_for_arrivals:
            plan = self.arrivals.room(plan, p, spent_ms, now_t, arrival_key, engine.bands)
        prompt = p.prompt
        k = plan.chosen_k if plan.chosen_k is not None else 0
        if k != (p.plan.chosen_k or 0):
            _, builder = self.scaffold_and_builder()
            r = p.request
            prompt = self.laid_out(builder, p.scaffold.text, self.prompt_chunks(p.retrieval.hits)[:k],
                                   r.question, r.history, earlier=p.full_prompt.earlier)
        timings = dict(p.timings_ms)
        timings["planning_ms"] = timings.get("planning_ms", 0.0) + (time.perf_counter() - t0) * 1000.0
        return replace(p, plan=plan, prompt=prompt, planner_profile=planner_profile,
                       correction=correction, late_bound=True, timings_ms=timings)

    def _ticket(self, p: Prepared) -> Ticket:
        """``p``'s predicted time on the model for the queue: the planned prompt's prefill p50
        and ``max_new_tokens`` decode steps at the profile's TPOT (ms)."""
        k = p.plan.chosen_k if p.plan.chosen_k is not None else 0
        row = p.plan.rows[k]
        return Ticket(prefill_ms=row.ttft_p50_ms, tpot_ms=p.profile.predict_tpot_ms(row.prompt_tokens),
                      max_new_tokens=p.max_new_tokens)

    @staticmethod
    def gen_params(req: AnswerRequest, max_new_tokens: int) -> GenParams:
        """The decoding parameters of ``req`` with its resolved ``max_new_tokens``, checked.

        Raises:
            InvalidInput: ``invalid_sampling_parameter`` (:meth:`GenParams.validate`).
        """
        return GenParams(max_new_tokens=max_new_tokens, temperature=req.temperature,
                         top_p=req.top_p, seed=req.seed, ignore_eos=req.ignore_eos,
                         min_tokens=req.min_tokens).validate()

    def _arrive(self, req: AnswerRequest, arrival_t: float) -> int | None:
        """Count ``req`` as arrived (:meth:`Arrivals.arrive`) with its budget and decode length;
        None when they are not valid (:meth:`prepare` then refuses it)."""
        from foundation.errors import InvalidInput

        try:
            budget = check_budget(self.settings, req.ttft_budget_ms)
            max_new = check_max_new_tokens(self.settings, req.max_new_tokens)
        except InvalidInput:
            return None
        return self.arrivals.arrive(arrival_t, budget, max_new)

    def _check_reachable(self, p: Prepared, spent_ms: float, wait_ms: float, where: str) -> None:
        """Refuse ``p`` (``on_budget_miss == "reject"``) when k = 0's predicted p50 TTFT is over budget.

        ``spent_ms``: time already spent; ``wait_ms``: the least wait still ahead (0 once
        the request has the model). Predicted TTFT of k = 0 = spent + wait + its prefill p50.

        Raises:
            BudgetUnreachable: 503 with the predicted TTFT and a Retry-After (the queue's
                :meth:`GenerationQueue.retry_after_ms`: its predicted wait, or with a free place
                the time until a running answer ends; at least 1 s); ``retryable`` False when
                no retry can help: the time spent before any wait (``timings_ms["overhead_ms"]``)
                plus k = 0's prefill p50 on an idle engine (:meth:`PlanBands.alone`) is over the
                budget too.
        """
        row = p.plan.rows[0]
        predicted = spent_ms + wait_ms + row.ttft_p50_ms
        if predicted <= p.budget_ms:
            return
        self.metrics.rejections.labels(where=where).inc()
        engine = self.engine_of(p)
        # the soonest any engine in rotation frees a place (one engine: its own queue's)
        retry_ms = min((e.queue.retry_after_ms() for e in self.engines.values() if e.healthy),
                       default=engine.queue.retry_after_ms())
        retry_s = max(1.0, retry_ms / 1000.0)
        scaffold = int(p.full_prompt.scaffold_len)
        idle_p50 = float(engine.bands.alone(p.profile).predict_ttft_many(
            [row.prompt_tokens], [row.cached_tokens], [chunking_prefix(scaffold, row.cached_tokens)])[0][0])
        idle_ms = p.timings_ms.get("overhead_ms", 0.0) + idle_p50
        raise BudgetUnreachable(
            f"even k=0 is predicted to take {predicted:.0f} ms to the first token (p50), over the "
            f"{p.budget_ms:.0f} ms budget" + ("" if idle_ms <= p.budget_ms else
                                              f"; {idle_ms:.0f} ms with the model idle: a retry "
                                              "cannot make it"),
            retry_after_s=retry_s, predicted_ttft_ms=predicted, retryable=idle_ms <= p.budget_ms,
            idle_ttft_ms=idle_ms, budget_ms=p.budget_ms, predicted_wait_ms=wait_ms, where=where)

    def advise(self, req: AnswerRequest, arrival_t: float | None = None,
               auth_ms: float | None = None) -> Advice:
        """Retrieve and plan without generating: the per-k table, the choice, the profile.

        ``arrival_t``/``auth_ms``: as :meth:`prepare`.

        Raises:
            as :meth:`prepare`.
        """
        p = self.prepare(req, arrival_t, auth_ms)
        return Advice(
            question=p.request.question, ttft_budget_ms=p.budget_ms,
            revision=p.retrieval.revision, plan=PlanPublic.of(p.plan),
            profile=ProfileRef(id=p.profile.id, source=p.profile.source),
            candidates=Citation.of_hits(p.retrieval.hits),
            prompt_tokens=p.prompt.prompt_tokens, scaffold_cached=p.scaffold_cached,
            timings=AdviceTimings(**p.timings_ms),
            predicted_wait_ms=p.predicted_wait_ms, queue_depth=p.queue_depth,
            late_binding=self.switches.late_binding,
            correction=p.correction.to_dict() if p.correction is not None else None,
            engine_id=p.engine_id, fleet=p.fleet,
        )


    def _elsewhere(self, p: Prepared, failed: FleetEngine, params: GenParams, cancel: threading.Event,
                   arrival_key: int | None, state: InFlight) -> Moved | None:
        """Move ``p``, whose stream died before its first token on ``failed`` (out of rotation now),
        to the engine in rotation whose plan carries the most context in what is left of its budget
        (:func:`latency_model.fleet.choose` with the time spent so far); wait for a place there,
        bind k on it (:meth:`bind`) and start it there (:func:`app.answering.generate.start`,
        ``state.granted_t`` set then). Returns ``(prepared, engine, entered slot, stream, refusal,
        ticket)`` (stream and refusal as :func:`~app.answering.generate.start`); None when no other
        engine is in rotation, the answer must make its budget (``on_budget_miss: reject``) and no
        engine can make k = 0 in what is left of it, or the wait was cancelled. The plan's
        ``fleet`` record says ``retried_from`` and why."""
        others = [e for e in self.engines.values() if e.healthy and e is not failed]
        if not others:
            return None
        spent = (time.perf_counter() - p.arrival_t) * 1000.0
        looks = self._look(others, p.full_prompt)
        views = [EngineView(e.id, look["planner_profile"], look["wait_ms"],
                            int(e.generator.context_window), scaffold_cached=look["cached"],
                            in_flight=e.in_flight(), cached_tokens=look["cached_k"]) for e, look in looks]
        choice = self._choose(views, p.full_prompt, p.budget_ms, p.max_new_tokens, spent)
        if not choice.fits and (p.request.on_budget_miss or self.settings.on_budget_miss) == "reject":
            return None  # no budget left for even k = 0 elsewhere: the answer ends with the error
        target, plan_there = self._target(choice, views, p.full_prompt, p.budget_ms, p.max_new_tokens, spent,
                                     looks)
        engine = self.engines[target]
        look = dict(looks)[engine]
        fleet = {**choice.to_dict(), "retried_from": failed.id, "retry_reason": failed.health.reason}
        moved = replace(p, engine_id=target, profile=look["profile"], scaffold_cached=look["cached"],
                        planner_profile=look["planner_profile"], correction=look["correction"],
                        fleet=fleet)
        moved = replace(moved, plan=plan_there)
        ticket = self._ticket(moved)
        slot = engine.sync_slots().slot(cancel, ticket)
        try:
            slot.__enter__()
        except Cancelled:
            return None
        try:
            with engine.bands.admit_lock:
                moved = self.bind(moved, arrival_key=arrival_key)
                ticket.prefill_ms = self._ticket(moved).prefill_ms
                moved = replace(moved, granted_band=engine.bands.batched(moved.profile, moved.profile))
                stream, refused = start(engine.generator, moved, params, cancel)
                engine.arm_first_token(stream, moved)
                state.granted_t = granted_t(stream)
        except BaseException:
            slot.__exit__(None, None, None)
            raise
        return moved, engine, slot, stream, refused, ticket
