"""The answer pipeline: retrieve -> plan -> assemble -> generate -> receipt.

Timing definitions (vLLM's benchmark conventions, docs/architecture.md "Contracts"):

* arrival: the one clock. Over HTTP, the moment the server's outermost middleware
  first sees the request (:mod:`app.api.clock`), so authentication, body parsing
  and validation are inside; for ``ragbudget ask``, the call itself.
* ``auth_ms``: the API key check (part of the time before the plan).
* ``queue_ms``: wait for the model (the bounded FIFO in :mod:`app.genqueue`).
* ``planning_ms``: prompt building and the plan.
* ``prefill_ms``: the model granted to the first token with text.
* ``ttft_ms``: request arrival to the first generated token with non-empty
  text, auth, queue and retrieval included.

Late binding (``late_binding``, on by default): retrieval and the full prompt
are built on arrival, and a first plan is made with the time spent so far plus
the queue's predicted wait (:meth:`app.genqueue.GenerationQueue.predicted_wait_ms`;
``POST /v1/advise`` reports it). The k the answer uses is chosen again when the
request gets the model, by :meth:`AnswerPipeline.bind` (the one hook a scheduler
calls), from the budget minus the time actually spent. With ``online_correction``
the plans use the fitted profile under :mod:`latency_model.correction`, fed by
every answer's measured prefill (both kept by :mod:`app.plan_bands`).

Room for arrivals (``room_for_arrivals``, on by default, with late binding and a
batching engine with a step model): the engine prefills answers in the order
they were granted, so an answer granted now delays the prefill of every request
that has already arrived and not yet got the model. Bound alone, the first of
several requests arriving together takes the whole budget's worth of chunks and
leaves the others too little time to answer even with k = 0 (on the load grid:
two clients in lockstep, the second always at k = 0 near its budget; four, the
other three refused fast over and over). :meth:`app.arrivals.Arrivals.room`
caps k at the largest that still lets each of them, priced behind it at p95 with
k = 0 and the time it has already spent, answer within its own budget (binding
``arrivals``); a request that could not make it even then is not counted.

Engines (:mod:`app.fleet`; ``RAGBUDGET_ENGINES``, one engine ``default`` without a list): on
arrival every engine in rotation is planned for with its own profile, correction, predicted
wait (other clients' load included) and context window, and
:func:`latency_model.fleet.choose` picks the engine and k that carry the most context within
the budget; the request joins that engine's queue, and :meth:`AnswerPipeline.bind` chooses k
again on it. A stream that dies before its first token on an engine that cannot be reached
takes that engine out of rotation and is answered once by another (:meth:`_elsewhere`).

When even ``k = 0`` cannot make the budget (``on_budget_miss``): ``answer``
answers anyway with ``binding == "nothing_fits"``; ``reject`` raises
:class:`foundation.errors.BudgetUnreachable` (503, no receipt), on arrival when
even the least possible wait rules it out (:meth:`GenerationQueue.min_wait_ms`),
or when it gets the model. The test is k = 0's predicted *p50* TTFT above the
budget: a request k = 0 would more likely than not have answered in time is
never refused.
* ``tpot_ms``: mean gap between later tokens, ``(t_last - t_first) / (n - 1)``.
* ``retrieval_ms``: query embedding + search + fetch.

Every answer (ok, cancelled or failed after the pipeline started) writes
exactly one receipt (:func:`receipts.chain.append_receipt`). An answer that gets the
model first writes a journal row (:mod:`receipts.journal`), deleted with the receipt's
append; should the process die before that, the next start records the answer as
``interrupted``. Both are assembled in :mod:`app.answer_receipt`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from app.answer_receipt import AnswerReceipts
from app.answer_state import Admission, AnswerEvent, AnswerRequest, InFlight, Prepared
from app.answer_types import (
    Advice,
    AdviceTimings,
    Answer,
    AnswerError,
    Citation,
    PlanPublic,
    ProfileRef,
)
from app.arrivals import Arrivals
from app.conversation import check_roles, retrieval_query
from app.fleet import FleetEngine, engine_gone
from app.genqueue import Cancelled, Ticket
from app.kv_lookup import cached_per_k, pin_prompt
from app.metrics import AnswerMetrics
from app.plan_bands import PlanBands
from app.services import Services
from app.settings import DEFAULT_ENGINE_ID, EngineConfig
from app.tracing import answer_tracer
from app.validation import (
    check_budget,
    check_k,
    check_max_new_tokens,
    check_on_budget_miss,
    check_question,
)
from foundation.errors import BudgetUnreachable, ContextLengthExceeded, RagBudgetError, Unavailable
from generation.base import GenParams, TokenStream
from generation.stopping import StopMatcher
from latency_model.fleet import EngineView, FleetChoice, choose
from latency_model.planner import Plan, PrefillBand, chunking_prefix
from latency_model.profile import Profile

if TYPE_CHECKING:
    from app.models import Scaffold
    from app.prompt import Prompt, PromptBuilder, PromptChunk
    from retrieval.retriever import Hit


#: An answer moved to another engine (:meth:`AnswerPipeline._elsewhere`): ``(prepared, engine,
#: entered slot, stream, refusal, ticket)``.
_Moved = tuple[Prepared, FleetEngine, Any, TokenStream | None, Exception | None, Ticket]

log = logging.getLogger("ragbudget.pipeline")
#: The id of this server's one engine when no engine list is configured.
ENGINE_ID = DEFAULT_ENGINE_ID


class AnswerPipeline:
    """Answers questions for one :class:`Services`; holds the engines (each with its queue and
    planning band, :mod:`app.fleet`) and the metrics. ``queue`` and ``bands`` are the first
    engine's (the only one's without an engine list)."""

    def __init__(self, services: Services, metrics: AnswerMetrics | None = None) -> None:
        self.services = services
        self.settings = services.settings
        self.metrics = metrics or AnswerMetrics()
        # Switches for an A/B in one process (benchmarks/load.py); default from the settings.
        self.late_binding = bool(self.settings.late_binding)
        self.online_correction = bool(self.settings.online_correction)
        self.live_speed = bool(self.settings.correction_live_speed)
        self.room_for_arrivals = bool(getattr(self.settings, "room_for_arrivals", True))
        # The order the chosen chunks are shown in (app.layout); a switch for an A/B in one process.
        self.prompt_layout = str(getattr(self.settings, "prompt_layout", "rank"))
        # The baselines a fleet benchmark compares the joint choice with (benchmarks/fleet.py):
        # "round_robin" (a plain load balancer) or "least_ttft" (the engine with the least
        # predicted TTFT at the given k, llm-d's idea), each at ``fixed_k``; "joint": the
        # fleet planner's engine and k (the product's behaviour).
        self.routing = "joint"
        self.fixed_k: int | None = None
        self._round_robin = itertools.count()
        self._lock = threading.Lock()
        # Each engine's queue, planning band (the online correction and the answers granted but
        # not yet seen by the engine: app.plan_bands, reading the switches above when used) and
        # health (app.fleet), in configured order.
        listed = getattr(self.settings, "engine_list", None)
        configs = listed() if callable(listed) else [EngineConfig(id=ENGINE_ID, kind="local")]
        self.engines: dict[str, FleetEngine] = {c.id: FleetEngine(self, c, i) for i, c in enumerate(configs)}
        first = next(iter(self.engines.values()))
        self.queue = first.queue
        self.bands: PlanBands = first.bands
        # The requests arrived and not yet granted the model (app.arrivals), left room to answer.
        self.arrivals = Arrivals()
        self.receipts = AnswerReceipts(self)  # each answer's summary, receipt and journal row
        self.tracer = answer_tracer(self.settings, self.metrics)  # None: otlp_endpoint unset
        self._scaffold: Scaffold | None = None
        self._builder: PromptBuilder | None = None

    # --- building blocks -----------------------------------------------------
    def scaffold_and_builder(self) -> tuple[Scaffold, PromptBuilder]:
        """The stored default scaffold and the prompt builder for the generator (cached)."""
        with self._lock:
            if self._builder is None:
                from app.prompt import DEFAULT_SCAFFOLD_NAME, DEFAULT_SCAFFOLD_TEXT, ensure_scaffold

                self.services.generator  # noqa: B018 - loaded first, as before: start-up errors surface here
                self._scaffold = ensure_scaffold(self.services.engine, DEFAULT_SCAFFOLD_NAME,
                                                 DEFAULT_SCAFFOLD_TEXT)
                self._builder = self.services.prompt_builder
            assert self._scaffold is not None
            return self._scaffold, self._builder

    def warm(self) -> dict[str, float]:
        """Load everything an answer needs, outside any request's clock; ms per step.

        Loads the embedder and the index (one throw-away retrieval), the generator,
        the scaffold and its prefix KV cache, and the latency profile, so the first
        request's TTFT measures serving, not start-up.
        """
        out: dict[str, float] = {}
        t = time.perf_counter()
        self.services.retriever.retrieve("warm-up", 1)
        out["retriever_ms"] = (time.perf_counter() - t) * 1000.0
        t = time.perf_counter()
        scaffold, builder = self.scaffold_and_builder()
        out["generator_ms"] = (time.perf_counter() - t) * 1000.0
        out["prefix_cache_ms"] = float(self.services.generator.warm_prefix(
            builder.scaffold_ids(scaffold.text)))
        t = time.perf_counter()
        self.profile()
        out["profile_ms"] = (time.perf_counter() - t) * 1000.0
        return out

    def profile(self) -> Profile:
        """The latency profile in force for the (first engine's) generator (fitted, else a prior)."""
        from app.profile_store import current_profile

        return current_profile(self.services)

    def engine_of(self, p: Prepared) -> FleetEngine:
        """The engine ``p`` was routed to.

        Raises:
            NotFound: ``unknown_engine`` (not one of this pipeline's engines).
        """
        try:
            return self.engines[p.engine_id]
        except KeyError:
            from foundation.errors import NotFound

            raise NotFound(f"engine {p.engine_id!r} is not configured", code="unknown_engine",
                           engine_id=p.engine_id) from None

    def in_rotation(self) -> list[FleetEngine]:
        """The engines in rotation, in configured order.

        Raises:
            Unavailable: ``engine_unavailable``, every engine is out of rotation (each is probed
                and rejoins when it answers: :class:`app.fleet.EngineHealth`).
        """
        up = [e for e in self.engines.values() if e.healthy]
        for e in self.engines.values():
            if not e.healthy:
                self.metrics.engine_state(e.id, False, None)
        if not up:
            down = {e.id: e.health.reason for e in self.engines.values()}
            raise Unavailable(f"no engine is in rotation ({'; '.join(f'{k}: {v}' for k, v in down.items())})",
                              code="engine_unavailable", engines=down)
        return up

    def close(self) -> None:
        """Stop the engines' background threads (:meth:`app.fleet.FleetEngine.close`)."""
        for e in self.engines.values():
            e.close()

    def bands_of(self, profile_id: str) -> PlanBands:
        """The planning bands (and online correction) of the engine that last planned with the
        profile ``profile_id``; the first engine's when none has."""
        for e in self.engines.values():
            if e.profile_id == profile_id:
                return e.bands
        return self.bands

    def fleet_status(self) -> list[dict[str, object]]:
        """Every engine's :meth:`app.fleet.FleetEngine.status`, in configured order."""
        return [e.status() for e in self.engines.values()]

    @staticmethod
    def prompt_chunks(hits: list[Hit]) -> list[PromptChunk]:
        """The prompt slots of retrieval hits (:func:`app.slots.prompt_slots`), in slot order: one
        :class:`PromptChunk` per distinct chunk text, citing every hit that has it. A prompt of k
        slots is the first k of the slots of *all* the candidates, never the slots of ``hits[:k]``."""
        from app.slots import prompt_slots

        return prompt_slots(hits)

    def laid_out(self, builder: PromptBuilder, scaffold_text: str, chunks: list[PromptChunk],
                 question: str, history: Any) -> Prompt:
        """The prompt of ``chunks`` (the chosen slots, slot order) in this pipeline's layout
        (:mod:`app.layout`): exactly ``full.ids_for(len(chunks))`` of :meth:`PromptBuilder.candidates`."""
        from app.layout import layout_order

        return builder.build(scaffold_text, chunks, question, history,
                             order=layout_order(chunks, self.prompt_layout), layout=self.prompt_layout)

    # --- advise ------------------------------------------------------------------
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
                ``max_new_tokens`` asked for does not fit beside it (:meth:`_fit_window`).
            UnknownRevision: ``req.revision`` does not exist.
        """
        arrival_t = arrival_t if arrival_t is not None else time.perf_counter()
        s = self.settings
        question = check_question(s, req.question)
        budget = check_budget(s, req.ttft_budget_ms)
        self._refuse_output_over_window(req.max_new_tokens)
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
        full = builder.candidates(scaffold.text, self.prompt_chunks(result.hits), question, req.history,
                                  layout=self.prompt_layout)
        engines = self.in_rotation()
        window = max(int(e.generator.context_window) for e in engines)
        max_new = self._fit_window(full.prompt_tokens_for(0), max_new, req.max_new_tokens is None, window)
        looks = self._look(engines, full)
        overhead_ms = (time.perf_counter() - arrival_t) * 1000.0
        views = [EngineView(e.id, look["planner_profile"],
                            look["wait_ms"] if self.late_binding else 0.0,
                            int(e.generator.context_window), scaffold_cached=look["cached"],
                            in_flight=e.in_flight(), cached_tokens=look["cached_k"])
                 for e, look in looks]
        choice = self._choose(views, full, budget, max_new, overhead_ms)
        if self.routing == "joint":
            engine_id, plan = self._target(choice, views, full, budget, max_new, overhead_ms, looks)
        else:
            engine_id, plan = self._baseline(views, full, budget, max_new, overhead_ms)
        look = dict(looks)[self.engines[engine_id]]
        profile, planner_profile, correction = look["profile"], look["planner_profile"], look["correction"]
        cached, wait_ms, depth = look["cached"], look["wait_ms"], look["depth"]
        k = plan.chosen_k if plan.chosen_k is not None else 0
        prompt = self.laid_out(builder, scaffold.text, self.prompt_chunks(result.hits)[:k], question,
                               req.history)
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
        )

    def _look(self, engines: list[FleetEngine], full: Prompt) -> list[tuple[FleetEngine, dict[str, Any]]]:
        """What the planner needs of each engine now: its profile, planning band and correction
        (:meth:`PlanBands.planner_profile`), whether it caches ``full``'s scaffold and how many
        tokens of each candidate prompt it caches (:func:`app.kv_lookup.cached_per_k`), its queue's
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
                            # what its prefix cache holds of each candidate prompt (app.kv_lookup)
                            "cached_k": cached_per_k(e.generator, full),
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
        if self.fixed_k is None:
            return plan
        return replace(plan, chosen_k=min(int(self.fixed_k), len(plan.rows) - 1), binding="fixed")

    def _baseline(self, views: list[EngineView], full: Prompt, budget: float, max_new: int,
                  overhead_ms: float) -> tuple[str, Plan]:
        """The engine and plan of a baseline ``routing`` (benchmarks only): ``round_robin`` takes
        the engines in turn; ``least_ttft`` the one with the least predicted p95 TTFT (its wait
        plus the prefill) at ``fixed_k``; either at ``fixed_k`` when set."""
        plans = [(v, self._choose([v], full, budget, max_new, overhead_ms).plan) for v in views]
        if self.routing == "round_robin":
            view, plan = plans[next(self._round_robin) % len(plans)]
        else:
            def ttft(item: tuple[EngineView, Plan | None]) -> float:
                v, pl = item
                assert pl is not None
                k = min(int(self.fixed_k or 0), len(pl.rows) - 1)
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

    def _refuse_output_over_window(self, max_new: int | None) -> None:
        """Refuse an output limit as long as the largest context window in rotation: no prompt
        fits beside it, so it is the context-window error (as vLLM answers it) before the
        server's own cap (``invalid_max_new_tokens``) is checked.

        Raises:
            ContextLengthExceeded: ``field`` ``max_new_tokens``, ``max_new_tokens``,
                ``context_window`` (no ``prompt_tokens``: the prompt is not built yet).
            Unavailable: ``engine_unavailable`` (:meth:`in_rotation`).
        """
        if max_new is None or isinstance(max_new, bool) or not isinstance(max_new, int):
            return  # absent, or a type check_max_new_tokens refuses
        window = max(int(e.generator.context_window) for e in self.in_rotation())
        if max_new >= window:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {window} tokens. However, you requested "
                f"{max_new} tokens for the output alone. Please reduce the length of the output "
                f"(max tokens).", field="max_new_tokens", max_new_tokens=max_new, context_window=window)

    @staticmethod
    def _fit_window(prompt_tokens: int, max_new: int, defaulted: bool, window: int) -> int:
        """The output tokens an answer may take beside its prompt without a retrieved chunk.

        ``prompt_tokens``: scaffold, conversation, question and chat framing (k = 0);
        ``max_new``: the output tokens asked for, or the server's default when ``defaulted``
        (then cut to what the window leaves, as vLLM does when ``max_tokens`` is absent);
        ``window``: the model's context window. Returns ``max_new``, cut when defaulted.

        Raises:
            ContextLengthExceeded: the prompt alone fills the window (``field`` ``question``),
                or ``max_new`` asked for does not fit beside it (``field`` ``max_new_tokens``):
                refused before the request queues, never cut short after its first token.
        """
        fits = window - prompt_tokens
        if fits >= max_new:
            return max_new
        if fits >= 1 and defaulted:
            return fits
        field = "question" if fits < 1 else "max_new_tokens"
        raise ContextLengthExceeded(
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt_tokens + max_new} tokens ({prompt_tokens} in the prompt, {max_new} for the "
            f"output). Please reduce the length of the "
            f"{'messages' if field == 'question' else 'output (max tokens)'}.",
            field=field, prompt_tokens=prompt_tokens, max_new_tokens=max_new, context_window=window)

    def _plan(self, full: Prompt, cached: bool, budget: float, max_new: int,
              profile: PrefillBand, overhead_ms: float, engine: FleetEngine | None = None) -> Plan:
        """The planner over all K candidates of ``full`` on ``engine`` (default: the first) with
        ``overhead_ms`` already gone.

        Planned through the fleet planner (:func:`latency_model.fleet.choose`) with that one
        engine, whose wait is already inside ``overhead_ms``: exactly the single-engine plan
        (``tests/latency_model/test_fleet.py`` pins that). The engine's prefix cache is looked up
        now (:func:`app.kv_lookup.cached_per_k`): at :meth:`bind`, the last look before admission.
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
        if self.fixed_k is not None:
            plan = self._fixed(plan)
        elif self.room_for_arrivals:
            plan = self.arrivals.room(plan, p, spent_ms, now_t, arrival_key, engine.bands)
        prompt = p.prompt
        k = plan.chosen_k if plan.chosen_k is not None else 0
        if k != (p.plan.chosen_k or 0):
            _, builder = self.scaffold_and_builder()
            r = p.request
            prompt = self.laid_out(builder, p.scaffold.text, self.prompt_chunks(p.retrieval.hits)[:k],
                                   r.question, r.history)
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
            late_binding=self.late_binding,
            correction=p.correction.to_dict() if p.correction is not None else None,
            engine_id=p.engine_id, fleet=p.fleet,
        )

    # --- answer ------------------------------------------------------------------
    def stream(self, req: AnswerRequest, *, cancel: threading.Event | None = None,
               arrival_t: float | None = None, auth_ms: float | None = None) -> Iterator[AnswerEvent]:
        """Answer ``req``, yielding one ``admitted`` event when it gets the model (its
        :class:`~app.answer_state.Admission`: the reserved receipt id and the plan), its token
        events, then one final (or error) event. An answer cancelled while it waits for the
        model has no ``admitted`` event, only the final one.

        Validation and retrieval errors raise before anything is yielded (no
        receipt: nothing was generated). Once generation starts, a failure or a
        cancellation ends the stream with an ``error``/``final`` event and still
        writes the receipt. ``arrival_t``/``auth_ms``: as :meth:`prepare`.

        Raises:
            RagBudgetError: bad input, unknown revision, queue full (Busy), even k = 0
                over budget with ``on_budget_miss == "reject"`` (BudgetUnreachable; nothing
                generated, no receipt).
        """
        arrival_t = arrival_t if arrival_t is not None else time.perf_counter()
        cancel = cancel or threading.Event()
        # Counted as arrived until it gets the model, so answers granted meanwhile leave it room.
        arrival_key = self._arrive(req, arrival_t)
        try:
            prepared = self.prepare(req, arrival_t, auth_ms)
            reject = (req.on_budget_miss or self.settings.on_budget_miss) == "reject"
            self.metrics.queue_state(prepared.queue_depth, prepared.predicted_wait_ms)
            if reject:
                # On arrival: the time spent plus the least the wait can be (every answer ahead
                # stopping at its first token); the exact check follows when the model is free.
                self._check_reachable(prepared, prepared.timings_ms["overhead_ms"],
                                      self.engine_of(prepared).queue.min_wait_ms(), "arrival")
        except BaseException:
            self.arrivals.left(arrival_key)
            raise
        # The engine the fleet planner chose (app.fleet): its generator, queue and bands.
        engine = self.engine_of(prepared)
        gen, bands = engine.generator, engine.bands
        # A generator that batches answers (the local engine: generation.scheduler, a remote
        # engine with several slots) says how many it runs at once; any other runs one at a time.
        queue = engine.sync_slots()
        # resolved(): a sampling request without a seed gets one drawn now, so it is recorded.
        params = self.gen_params(req, prepared.max_new_tokens).resolved()
        state = InFlight()
        # Stop strings are cut here, on the decoded text of whatever backend streams it, and
        # the same way in replay (app.receipt_wiring): one place, generation.stopping.
        stopper = StopMatcher(list(req.stop))
        ticket = self._ticket(prepared)
        slot: AbstractContextManager[float] | None = queue.slot(cancel, ticket)
        receipt_id: str | None = None  # reserved by the journal row once the answer has the model
        # The answer in its generator from the grant on (the local engine queues it at once, so
        # the engine alone shows who waits: the next answer granted plans beside it).
        stream: TokenStream | None = None
        refused: Exception | None = None  # stream() refused it: raised where its tokens are read
        pin: Any = None  # its planned cached chain, held until the engine admits it (app.kv_lookup)
        queued_t = time.perf_counter()
        try:
            state.queue_ms = slot.__enter__()  # type: ignore[union-attr]
            try:
                with bands.admit_lock:
                    if self.late_binding:
                        prepared = self.bind(prepared, arrival_key=arrival_key)
                        ticket.prefill_ms = self._ticket(prepared).prefill_ms
                    # The running batch this answer joins, for the correction to learn against.
                    joined = bands.batched(prepared.profile, prepared.profile)
                    prepared = replace(prepared, granted_band=joined)
                    if reject:
                        self._check_reachable(prepared, prepared.plan.overhead_ms, 0.0, "granted")
                    pin = pin_prompt(gen, prepared.prompt)
                    stream, refused = self._start(gen, prepared, params, cancel)
                    engine.arm_first_token(stream, prepared)  # a remote engine's deadline (app.fleet)
                    self.arrivals.left(arrival_key)  # now counted among the prefills granted
                # Before the first token is read, outside queue_ms (inside ttft_ms).
                receipt_id = self.receipts.open_journal(prepared, params, state)
                state.granted_t = self._granted_t(stream)
            except BaseException:
                if pin is not None:
                    pin.release()
                if stream is not None:
                    stream.close()
                state.granted_t = None
                self.arrivals.left(arrival_key)
                slot.__exit__(None, None, None)  # type: ignore[union-attr]
                raise
        except Cancelled:
            self.arrivals.left(arrival_key)
            state.status = "cancelled"
            state.queue_ms = (time.perf_counter() - queued_t) * 1000.0  # waited, then left
            slot = None
        try:
            if slot is not None:
                # The receipt id and the plan, before the first token: the API sends them as headers.
                yield AnswerEvent("admitted", admission=self._admission(prepared, state, receipt_id))
                # The stream is closed as the loop ends, and on every other exit (finally below):
                # the generator drops the answer and finalises its stats even when the loop stops
                # early (stop string, cancel, client gone).
                retried = False
                while True:
                    try:
                        if refused is not None:
                            raise refused
                        assert stream is not None
                        for ev in stream:
                            state.n += 1
                            ticket.produced = state.n
                            state.last_t = ev.t
                            state.ids_per_event = state.ids_per_event and ev.token_id >= 0
                            if state.first_t is None and ev.text:
                                state.first_t = ev.t
                            released, stopped = stopper.feed(ev.text)
                            if released:
                                state.text.append(released)
                                yield AnswerEvent("token", text=released, tokens=state.n)
                            if stopped:
                                state.stop = stopper.matched
                                break
                            if cancel.is_set():
                                break
                        break
                    except Exception as exc:
                        # A stream that dies before its first token on an engine that cannot be
                        # reached is tried once more on another engine in rotation (app.fleet).
                        if retried or state.n or not engine_gone(exc):
                            raise
                        engine.health.mark_down(f"{type(exc).__name__}: {exc}")
                        self.metrics.engine_retries.labels(engine=engine.id).inc()
                        moved = self._elsewhere(prepared, engine, params, cancel, arrival_key, state)
                        if moved is None:
                            raise
                        log.warning("engine %s failed before the first token (%s); retrying on %s",
                                    engine.id, exc, moved[0].engine_id)
                        if stream is not None:
                            stream.close()
                        slot.__exit__(None, None, None)
                        prepared, engine, slot, stream, refused, ticket = moved
                        gen, bands, retried = engine.generator, engine.bands, True
                if stream is not None:
                    stream.close()
                held = stopper.flush()
                if held:
                    state.text.append(held)
                    yield AnswerEvent("token", text=held, tokens=state.n)
                if cancel.is_set() and state.stop is None:
                    state.status = "cancelled"
        except GeneratorExit:
            state.status = "cancelled"
            cancel.set()
            raise
        except Exception as exc:  # generation failed after the stream started
            log.exception("generation failed")
            if engine_gone(exc):  # refused or dropped connection: out of rotation, probed (app.fleet)
                engine.health.mark_down(f"{type(exc).__name__}: {exc}")
            state.status = "failed"
            state.error = AnswerError(code=str(getattr(exc, "code", "generation_failed")),
                                      message=str(exc))
        finally:
            self.arrivals.left(arrival_key)
            if pin is not None:
                pin.release()  # a no-op once the engine admitted the answer
            if stream is not None:
                stream.close()  # ends it where it is (a no-op once it ran out)
            if slot is not None:
                slot.__exit__(None, None, None)
                # This answer's stats on every path (ok, break, client gone, error); None when
                # the generator refused it or ended it before starting it.
                state.stats = stream.stats if stream is not None else None
            summary = self.receipts.finish(prepared, params, state, receipt_id)
            if self.tracer is not None:  # spans queued, sent off the request path (app.tracing)
                self.tracer.export(prepared, params, summary, gen.identity)
        if state.status == "failed":
            yield AnswerEvent("error", summary=summary)
        else:
            yield AnswerEvent("final", summary=summary)

    @staticmethod
    def _start(gen: Any, p: Prepared, params: GenParams,
               cancel: threading.Event) -> tuple[TokenStream | None, Exception | None]:
        """Hand ``p``'s prompt to ``gen``: ``(its stream, None)``, or ``(None, the error)`` when
        ``gen.stream`` refuses it (a bad prompt or parameters), which the caller raises where
        the answer's tokens are read, so it ends as a failed answer with its receipt. Called
        under the engine's admit lock: the local engine queues the answer now, in grant order."""
        try:
            stream = gen.stream(p.prompt.ids, cached_prefix_ids=p.prompt.scaffold_ids, params=params,
                                cancel=cancel, messages=p.prompt.messages or None)
        except Exception as exc:
            return None, exc
        return stream, None

    @staticmethod
    def _granted_t(stream: TokenStream | None) -> float:
        """When the model was granted to the answer of ``stream``, ``perf_counter`` seconds (where
        its measured prefill starts): when its engine took it (``accepted_t``: the local engine,
        at ``stream()``), else now, just before its first ``next()`` (a remote server)."""
        if stream is not None and stream.accepted_t is not None:
            return stream.accepted_t
        return time.perf_counter()

    def _elsewhere(self, p: Prepared, failed: FleetEngine, params: GenParams, cancel: threading.Event,
                   arrival_key: int | None, state: InFlight) -> _Moved | None:
        """Move ``p``, whose stream died before its first token on ``failed`` (out of rotation now),
        to the engine in rotation whose plan carries the most context in what is left of its budget
        (:func:`latency_model.fleet.choose` with the time spent so far); wait for a place there,
        bind k on it (:meth:`bind`) and start it there (:meth:`_start`, ``state.granted_t`` set
        then). Returns ``(prepared, engine, entered slot, stream, refusal, ticket)`` (stream and
        refusal as :meth:`_start`); None when no other engine is in rotation, the answer must
        make its budget (``on_budget_miss: reject``) and no engine can make k = 0 in what is left
        of it, or the wait was cancelled. The plan's ``fleet`` record says ``retried_from`` and why."""
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
                stream, refused = self._start(engine.generator, moved, params, cancel)
                engine.arm_first_token(stream, moved)
                state.granted_t = self._granted_t(stream)
        except BaseException:
            slot.__exit__(None, None, None)
            raise
        return moved, engine, slot, stream, refused, ticket

    def _admission(self, p: Prepared, state: InFlight, receipt_id: str | None) -> Admission:
        """The :class:`Admission` of ``p`` as it gets the model (plan and prediction as its summary)."""
        snap, _ids, _prefill = self.receipts.summary(p, state)
        return Admission(receipt_id=receipt_id, chosen_k=snap.chosen_k, binding=snap.binding,
                         predicted=snap.predicted, ttft_budget_ms=snap.ttft_budget_ms,
                         prompt_tokens=snap.tokens.prompt)

    def answer(self, req: AnswerRequest, *, cancel: threading.Event | None = None,
               arrival_t: float | None = None, auth_ms: float | None = None) -> Answer:
        """Non-streaming :meth:`stream`: returns the final :class:`Answer` (with ``text``).

        Raises:
            as :meth:`stream`.
        """
        final: Answer | None = None
        for ev in self.stream(req, cancel=cancel, arrival_t=arrival_t, auth_ms=auth_ms):
            if ev.kind in ("final", "error") and ev.summary is not None:
                final = ev.summary
        assert final is not None, "the stream always ends with a final or error event"
        return final
