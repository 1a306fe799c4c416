"""The answer pipeline: retrieve -> plan -> assemble -> generate -> receipt.

Timing definitions (vLLM's benchmark conventions, docs/architecture.md "Contracts"):

* arrival: the one clock. Over HTTP, the moment the server's outermost middleware
  first sees the request (:mod:`app.api.clock`), so authentication, body parsing
  and validation are inside; for ``ragbudget ask``, the call itself.
* ``auth_ms``: the API key check (part of the time before the plan).
* ``queue_ms``: wait for the model (the bounded FIFO in :mod:`app.answering.genqueue`).
* ``planning_ms``: prompt building and the plan.
* ``prefill_ms``: the model granted to the first token with text.
* ``ttft_ms``: request arrival to the first generated token with non-empty
  text, auth, queue and retrieval included.

Late binding (``late_binding``, on by default): retrieval and the full prompt
are built on arrival, and a first plan is made with the time spent so far plus
the queue's predicted wait (:meth:`app.answering.genqueue.GenerationQueue.predicted_wait_ms`;
``POST /v1/advise`` reports it). The k the answer uses is chosen again when the
request gets the model, by :meth:`AnswerPipeline.bind` (the one hook a scheduler
calls), from the budget minus the time actually spent. With ``online_correction``
the plans use the fitted profile under :mod:`latency_model.correction`, fed by
every answer's measured prefill (both kept by :mod:`app.answering.bands`).

Room for arrivals (``room_for_arrivals``, on by default, with late binding and a
batching engine with a step model): the engine prefills answers in the order
they were granted, so an answer granted now delays the prefill of every request
that has already arrived and not yet got the model. Bound alone, the first of
several requests arriving together takes the whole budget's worth of chunks and
leaves the others too little time to answer even with k = 0 (on the load grid:
two clients in lockstep, the second always at k = 0 near its budget; four, the
other three refused fast over and over). :meth:`app.answering.arrivals.Arrivals.room`
caps k at the largest that still lets each of them, priced behind it at p95 with
k = 0 and the time it has already spent, answer within its own budget (binding
``arrivals``); a request that could not make it even then is not counted.

Engines (:mod:`app.fleet`; ``RAGBUDGET_ENGINES``, one engine ``default`` without a list): on
arrival every engine in rotation is planned for with its own profile, correction, predicted
wait (other clients' load included) and context window, and
:func:`latency_model.fleet.choose` picks the engine and k that carry the most context within
the budget; the request joins that engine's queue, and :meth:`AnswerPipeline.bind` chooses k
again on it. A stream that dies before its first token on an engine that cannot be reached
takes that engine out of rotation and is answered once by another
(:meth:`app.answering.admit.AdmitSteps._elsewhere`).

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
``interrupted``. Both are assembled in :mod:`app.answering.receipt`.

The answer's path through this package: :meth:`AnswerPipeline.stream` admits it
(:mod:`app.answering.admit`: validate, retrieve, plan, route, bind), waits for a place on its
engine (:mod:`app.answering.genqueue`), generates (:mod:`app.answering.generate`: start the
stream, read its tokens) and finishes it (:mod:`app.answering.finish`: the receipt, the
metrics, the trace, the closing event). This module holds the engines, the switches and the
one loop that ties the steps together, with every exit path (cancel, failure, retry).
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

from app.answering.admit import AdmitSteps
from app.answering.arrivals import Arrivals
from app.answering.bands import PlanBands
from app.answering.finish import admission_of, failed, finish, last_event
from app.answering.generate import flush, granted_t, read_tokens, start
from app.answering.genqueue import Cancelled
from app.answering.kv_lookup import pin_prompt
from app.answering.receipt import AnswerReceipts
from app.answering.state import AnswerEvent, AnswerRequest, AnswerSwitches, InFlight
from app.answering.types import Answer
from app.fleet import FleetEngine, engine_gone
from app.metrics import AnswerMetrics
from app.services import Services
from app.settings import DEFAULT_ENGINE_ID, EngineConfig
from app.tracing import answer_tracer
from foundation.errors import Unavailable
from generation.base import TokenStream
from generation.stopping import StopMatcher
from latency_model.profile import Profile

if TYPE_CHECKING:
    from app.answering.state import Prepared
    from app.models import Scaffold
    from app.prompting.prompt import Prompt, PromptBuilder, PromptChunk
    from retrieval.retriever import Hit

log = logging.getLogger("ragbudget.pipeline")
#: The id of this server's one engine when no engine list is configured.
ENGINE_ID = DEFAULT_ENGINE_ID


class _Switch:
    """An attribute of :class:`AnswerPipeline` read from and written to its ``switches``
    (:class:`app.answering.state.AnswerSwitches`), so ``pipeline.late_binding = False`` flips
    the switch every engine's bands read."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj.switches, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.switches, self.name, value)


class AnswerPipeline(AdmitSteps):
    """Answers questions for one :class:`Services`; holds the engines (each with its queue and
    planning band, :mod:`app.fleet`) and the metrics. ``queue`` and ``bands`` are the first
    engine's (the only one's without an engine list). Admission (prepare, plan, bind, advise)
    is :class:`app.answering.admit.AdmitSteps`."""

    late_binding = _Switch()
    online_correction = _Switch()
    live_speed = _Switch()
    room_for_arrivals = _Switch()
    prompt_layout = _Switch()
    follow_up_layout = _Switch()
    routing = _Switch()
    fixed_k = _Switch()

    def __init__(self, services: Services, metrics: AnswerMetrics | None = None) -> None:
        self.services = services
        self.settings = services.settings
        self.metrics = metrics or AnswerMetrics()
        # Switches for an A/B in one process (benchmarks/load.py, benchmarks/fleet.py), shared
        # with every engine's bands; default from the settings. Also set as this object's
        # attributes of the same names (``pipeline.late_binding = False``).
        self.switches = AnswerSwitches.of(self.settings)
        self._round_robin = itertools.count()
        self._lock = threading.Lock()
        # Each engine's queue, planning band (the online correction and the answers granted but
        # not yet seen by the engine: app.answering.bands, reading the switches when used) and
        # health (app.fleet), in configured order.
        listed = getattr(self.settings, "engine_list", None)
        configs = listed() if callable(listed) else [EngineConfig(id=ENGINE_ID, kind="local")]
        self.engines: dict[str, FleetEngine] = {c.id: FleetEngine(self, c, i) for i, c in enumerate(configs)}
        first = next(iter(self.engines.values()))
        self.queue = first.queue
        self.bands: PlanBands = first.bands
        # The requests arrived and not yet granted the model (app.answering.arrivals), left room to answer.
        self.arrivals = Arrivals()
        # each answer's summary, receipt and journal row
        self.receipts = AnswerReceipts(services, self.metrics, self.engine_of)
        self.tracer = answer_tracer(self.settings, self.metrics)  # None: otlp_endpoint unset
        self._scaffold: Scaffold | None = None
        self._builder: PromptBuilder | None = None

    # --- building blocks -----------------------------------------------------
    def scaffold_and_builder(self) -> tuple[Scaffold, PromptBuilder]:
        """The stored default scaffold and the prompt builder for the generator (cached)."""
        with self._lock:
            if self._builder is None:
                from app.prompting.prompt import DEFAULT_SCAFFOLD_NAME, DEFAULT_SCAFFOLD_TEXT, ensure_scaffold

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
                and rejoins when it answers: :class:`app.fleet.EngineHealth`); ``details.retry_after_s``
                is the shortest probe interval (s), sent as ``Retry-After``.
        """
        up = [e for e in self.engines.values() if e.healthy]
        for e in self.engines.values():
            if not e.healthy:
                self.metrics.engine_state(e.id, False, None)
        if not up:
            down = {e.id: e.health.reason for e in self.engines.values()}
            # The soonest any of them can rejoin is its next probe: the client is told to come back
            # then (HTTP ``Retry-After``), not to ask again at once.
            retry_s = min(e.health.interval_s for e in self.engines.values())
            raise Unavailable(f"no engine is in rotation ({'; '.join(f'{k}: {v}' for k, v in down.items())})",
                              code="engine_unavailable", engines=down, retry_after_s=retry_s)
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
        """The prompt slots of retrieval hits (:func:`app.prompting.slots.prompt_slots`), in slot order: one
        :class:`PromptChunk` per distinct chunk text, citing every hit that has it. A prompt of k
        slots is the first k of the slots of *all* the candidates, never the slots of ``hits[:k]``."""
        from app.prompting.slots import prompt_slots

        return prompt_slots(hits)

    def laid_out(self, builder: PromptBuilder, scaffold_text: str, chunks: list[PromptChunk],
                 question: str, history: Any, *, earlier: Any = None) -> Prompt:
        """The prompt of ``chunks`` (the chosen slots, slot order) in this pipeline's layout
        (:mod:`app.prompting.layout`): exactly ``full.ids_for(len(chunks))`` of
        :meth:`PromptBuilder.candidates`; ``earlier``: the earlier turn a follow-up continues
        (:mod:`app.answering.followup`; None: the history as text turns)."""
        from app.prompting.layout import layout_order

        return builder.build(scaffold_text, chunks, question, history,
                             order=layout_order(chunks, self.switches.prompt_layout),
                             layout=self.switches.prompt_layout, earlier=earlier)


    # --- answer ------------------------------------------------------------------
    def stream(self, req: AnswerRequest, *, cancel: threading.Event | None = None,
               arrival_t: float | None = None, auth_ms: float | None = None) -> Iterator[AnswerEvent]:
        """Answer ``req``, yielding one ``admitted`` event when it gets the model (its
        :class:`~app.answering.state.Admission`: the reserved receipt id and the plan), its token
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
        # the same way in replay (app.answering.receipt_wiring): one place, generation.stopping.
        stopper = StopMatcher(list(req.stop))
        ticket = self._ticket(prepared)
        slot: AbstractContextManager[float] | None = queue.slot(cancel, ticket)
        receipt_id: str | None = None  # reserved by the journal row once the answer has the model
        # The answer in its generator from the grant on (the local engine queues it at once, so
        # the engine alone shows who waits: the next answer granted plans beside it).
        stream: TokenStream | None = None
        refused: Exception | None = None  # stream() refused it: raised where its tokens are read
        pin: Any = None  # its planned cached chain, held until the engine admits it (kv_lookup)
        queued_t = time.perf_counter()
        try:
            state.queue_ms = slot.__enter__()  # type: ignore[union-attr]
            try:
                with bands.admit_lock:
                    if self.switches.late_binding:
                        prepared = self.bind(prepared, arrival_key=arrival_key)
                        ticket.prefill_ms = self._ticket(prepared).prefill_ms
                    # The running batch this answer joins, for the correction to learn against.
                    joined = bands.batched(prepared.profile, prepared.profile)
                    prepared = replace(prepared, granted_band=joined)
                    if reject:
                        self._check_reachable(prepared, prepared.plan.overhead_ms, 0.0, "granted")
                    pin = pin_prompt(gen, prepared.prompt)
                    stream, refused = start(gen, prepared, params, cancel)
                    engine.arm_first_token(stream, prepared)  # a remote engine's deadline (app.fleet)
                    self.arrivals.left(arrival_key)  # now counted among the prefills granted
                # Before the first token is read, outside queue_ms (inside ttft_ms).
                receipt_id = self.receipts.open_journal(prepared, params, state)
                state.granted_t = granted_t(stream)
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
                admission = admission_of(self.receipts, prepared, state, receipt_id)
                yield AnswerEvent("admitted", admission=admission)
                # The stream is closed as the loop ends, and on every other exit (finally below):
                # the generator drops the answer and finalises its stats even when the loop stops
                # early (stop string, cancel, client gone).
                retried = False
                while True:
                    try:
                        if refused is not None:
                            raise refused
                        assert stream is not None
                        yield from read_tokens(stream, state, ticket, stopper, cancel)
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
                yield from flush(stopper, state)
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
            failed(state, exc)
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
            summary = finish(self.receipts, self.tracer, prepared, params, state, receipt_id, gen.identity)
        yield last_event(state, summary)

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
