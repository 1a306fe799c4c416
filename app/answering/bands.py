"""The prefill band the answer pipeline plans with, and the online correction that learns it.

One :class:`PlanBands` per :class:`app.answering.pipeline.AnswerPipeline`. It answers "what will the
prefill of this prompt take, here and now": the fitted profile
(:mod:`latency_model.profile`), plus the time the local engine's running batch adds
(:class:`latency_model.step_model.BatchedBand`, when the profile has a step model), under the
online correction (:mod:`latency_model.correction`) when the pipeline's ``online_correction``
is on. It keeps:

* the correction registry (one correction per profile id), seeded from the window a previous
  process stored (:func:`app.profile_store.load_correction_window`) and fed, after every
  answer, the measured prefill against the batch-aware prediction (:meth:`PlanBands.learn`);
* the lock under which the pipeline binds an answer and hands it to its generator
  (:attr:`PlanBands.admit_lock`): the local engine queues an answer when ``stream()`` is
  called, so the engine's own snapshot (``Engine.batch_snapshot``) shows every answer granted
  before, and two answers granted at once plan against each other. The engine is the one
  owner of who waits for a prefill; nothing here keeps a second list of it.

* the pricer of a prefill behind everything running or granted (:meth:`PlanBands.behind`),
  with which an answer planned now leaves the requests arrived meanwhile room to answer
  (:meth:`app.answering.arrivals.Arrivals.room`);

* the machine's speed now, read from the local engine's latest timed steps against the
  profile's mixed-step model (:meth:`PlanBands.live_speed`,
  :func:`latency_model.step_model.machine_speed`): each answer is learned with the speed of
  the steps it ran in, and each plan scales the correction to the speed of the steps just
  run, so a machine that slows down shows in the next plan (``live_speed`` switch).

The pipeline's ``online_correction``, ``live_speed`` and ``residual_band`` switches are flipped
at run time (an A/B in one process, ``benchmarks/load.py``), so they are read from the shared
:class:`app.answering.state.AnswerSwitches` on every call, never copied here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.answering.types import PlanBatch
from generation.base import (
    SupportsBatchSnapshot,
    SupportsEngine,
    SupportsPrefillChunk,
    SupportsRecentSteps,
    SupportsStepBudget,
)
from generation.engine.messages import BatchSnapshot, Decoding, Prefilling
from latency_model.correction import ALONE, BATCHED, CorrectedProfile, CorrectionRegistry, CorrectionState
from latency_model.planner import PrefillBand
from latency_model.profile import Profile

if TYPE_CHECKING:
    from app.answering.state import AnswerSwitches, Prepared
    from app.metrics import AnswerMetrics
    from generation.base import GenerationStats

log = logging.getLogger("ragbudget.pipeline")

#: The speed read for a plan: the newest SPEED_STEPS engine steps, if the newest ended less
#: than SPEED_HORIZON_S ago (an idle engine says nothing about the machine now; the
#: correction then takes the speed of the newest answer it learned from).
SPEED_STEPS = 32
SPEED_HORIZON_S = 10.0


#: A prefill as the batch model takes it (the engine's snapshot entry): tokens to prefill,
#: first position, max new tokens, engine prefill order or None.
Entry = Prefilling


def _engine(generator: object) -> object | None:
    """The engine ``generator`` runs on (:class:`generation.base.SupportsEngine`), else None."""
    return generator.engine if isinstance(generator, SupportsEngine) else None


def _prefill_order(entry: Prefilling) -> float:
    """Sort key of a prefill ahead: its engine prefill order; an entry without one (a snapshot of
    an engine that reports none) keeps its place before those with one."""
    return float(entry.order) if entry.order is not None else -1.0


def group_of(band: Any) -> str:
    """The online correction group of a plan made with ``band``: :data:`BATCHED` when it is a
    :class:`latency_model.step_model.BatchedBand` (the engine was running other answers),
    else :data:`ALONE` (see :mod:`latency_model.correction`)."""
    from latency_model.step_model import BatchedBand

    return BATCHED if isinstance(band, BatchedBand) else ALONE


def batch_of(band: Any) -> PlanBatch | None:
    """The running batch a plan made with ``band`` (corrected or not) was made beside, or
    ``None`` when it was planned alone (:class:`app.answering.types.PlanBatch`: ``decoding``
    ``(context, decode steps left)`` each, -1 for a decoder given without its steps left;
    ``prefilling`` ``(prompt tokens left, next position, max new tokens)`` each; see
    :func:`latency_model.step_model.predict_batched_ttft_ms`). Shown in the answer's
    ``predicted.batch``, so a plan's batch model can be checked against what it measured."""
    from latency_model.step_model import BatchedBand

    if isinstance(band, CorrectedProfile):
        band = band.profile
    if not isinstance(band, BatchedBand):
        return None
    return PlanBatch(decoding=[(d.context_tokens, d.steps_left if d.steps_left is not None else -1)
                               for d in band.decode_contexts],
                     prefilling=[(e.tokens_left, e.position, e.max_new) for e in band.prefills_ahead])


class PlanBands:
    """The batch-aware planning band and the online correction of one engine.

    Args:
        switches: the pipeline's switches; ``online_correction`` and ``live_speed`` are read
            when used (they may change between answers).
        metrics: where each learned correction is reported.
        data_dir: returns the data directory the correction windows are stored in (None:
            nothing stored or loaded).
        correction_window: answers the online correction keeps (``correction_window``).
        generator: returns the generator of the engine these bands plan for (one
            :class:`PlanBands` per engine, :mod:`app.fleet`).
    """

    def __init__(self, switches: AnswerSwitches, metrics: AnswerMetrics,
                 data_dir: Callable[[], Path | None], correction_window: int,
                 generator: Callable[[], Any]) -> None:
        self._switches = switches
        self._metrics = metrics
        self._data_dir = data_dir
        self._generator: Callable[[], Any] = generator
        self.corrections = CorrectionRegistry(loader=self.stored_window, window=correction_window)
        # Binding an answer and handing it to the generator (whose engine queues it at once)
        # happen under ``admit_lock``, so two answers granted at once never both plan against
        # a batch that holds neither.
        self.admit_lock = threading.Lock()

    def _residual(self) -> bool:
        """The ``residual_band`` switch now (:mod:`latency_model.correction`; False, the earlier
        rule, when the switches predate it)."""
        return bool(getattr(self._switches, "residual_band", False))

    def planner_profile(self, profile: Profile) -> tuple[PrefillBand, CorrectionState | None]:
        """The profile plans use, and its online correction's state (None when off).

        The fitted profile, with the time the running batch's steps add when the local
        engine is running other answers and the profile has a mixed-step model
        (:class:`latency_model.step_model.BatchedBand`); under the online correction when
        that is on. The correction sits on top of the batch-aware prediction because it
        learns from it (:meth:`learn`): its factor and p95 multiplier are residuals of
        what the batch model already explains, not the batch itself a second time. The
        plan's correction group (:func:`group_of`) is the band's: alone or beside a batch.
        """
        band = self.batched(profile, profile)
        if self._switches.online_correction:
            use = bool(self._switches.live_speed)
            corrected = CorrectedProfile(band, self.corrections.get(profile.id),
                                         self.live_speed(profile) if use else None, use,
                                         group_of(band), self._residual())
            return corrected, corrected.state
        return band, None

    def alone(self, profile: Profile) -> PrefillBand:
        """The band a plan gets with the engine idle: the fitted profile with no running batch,
        under the online correction's alone group when that is on (:meth:`planner_profile`
        as it would be with nothing running). What tells a refusal that waiting cannot help."""
        if self._switches.online_correction:
            use = bool(self._switches.live_speed)
            return CorrectedProfile(profile, self.corrections.get(profile.id),
                                    self.live_speed(profile) if use else None, use, ALONE,
                                    self._residual())
        return profile

    def live_speed(self, profile: Profile, since_t: float | None = None,
                   until_t: float | None = None) -> float | None:
        """The machine's speed from the local engine's timed steps (1.0: as at calibration).

        Without ``since_t``: the newest :data:`SPEED_STEPS` steps, when the newest ended
        within :data:`SPEED_HORIZON_S`. With ``since_t`` / ``until_t`` (``perf_counter``
        seconds): the steps that ended in that span (an answer's life). ``None`` when the
        profile has no step model, the generator has no engine, or too few steps
        (:func:`latency_model.step_model.machine_speed`). Read whether or not the
        pipeline's ``live_speed`` switch is on (answers are stored with it either way);
        the switch decides whether plans use it.
        """
        from latency_model.step_model import machine_speed

        fit = getattr(profile, "step_fit", None)
        engine = _engine(self._generator())
        if fit is None or not isinstance(engine, SupportsRecentSteps):
            return None
        steps = engine.recent_steps()
        if since_t is None:
            if not steps or time.perf_counter() - steps[-1].t_end > SPEED_HORIZON_S:
                return None
            steps = steps[-SPEED_STEPS:]
        else:
            end = until_t if until_t is not None else time.perf_counter()
            steps = [r for r in steps if since_t <= r.t_end <= end]
        got = machine_speed(fit, steps)
        return got[0] if got is not None else None

    def behind(self, profile: Profile) -> Callable[[Sequence[Entry]], PrefillBand] | None:
        """A pricer for answers that will prefill after everything the engine runs or was
        granted now: called with ``extra`` (``(tokens to prefill, first position, max new
        tokens, order)`` each, in the order they will prefill), it returns the band of an answer
        behind them all (the running batch's band, :meth:`batched`, with ``extra`` appended),
        under the online correction's batched group when that is on. The engine's batch, the
        answers granted and the machine speed are read once, when the pricer is made, so
        pricing many candidates costs one snapshot. ``None`` without a step model or a
        batching engine (nothing to price it with)."""
        from latency_model.step_model import BatchedBand

        now = self._batch_now(profile)
        if now is None:
            return None
        fit, chunk, decoding, prefilling, budget = now
        on = bool(self._switches.online_correction)
        use = bool(self._switches.live_speed)
        correction = self.corrections.get(profile.id) if on else None
        speed = self.live_speed(profile) if on and use else None
        residual = self._residual()

        def price(extra: Sequence[Entry]) -> PrefillBand:
            band = BatchedBand(profile, fit, chunk, decoding, [*prefilling, *extra], budget)
            return band if correction is None else CorrectedProfile(band, correction, speed, use,
                                                                     BATCHED, residual)

        return price

    def _batch_now(self, profile: Profile
                   ) -> tuple[Any, int, list[Decoding], list[Prefilling], int | None] | None:
        """``(step fit, prefill chunk, decoders, prefills in the engine's order, step token
        budget)`` as the engine stands now (every answer granted is in it); None without a
        step model or a batching engine."""
        generator = self._generator()
        engine = _engine(generator)
        chunk = generator.prefill_chunk if isinstance(generator, SupportsPrefillChunk) else None
        fit = getattr(profile, "step_fit", None)
        if fit is None or not isinstance(engine, SupportsBatchSnapshot) or not chunk:
            return None
        snapshot: BatchSnapshot = engine.batch_snapshot()
        prefilling = sorted(snapshot.prefilling, key=_prefill_order)  # as the engine packs them
        budget = engine.step_token_budget if isinstance(engine, SupportsStepBudget) else None
        return (fit, int(chunk), list(snapshot.decoding), prefilling,
                int(budget) if isinstance(budget, int) else None)

    def batched(self, band: PrefillBand, profile: Profile) -> PrefillBand:
        """``band`` under the running batch's added step time, when there is one to model."""
        from latency_model.step_model import BatchedBand

        now = self._batch_now(profile)
        if now is None:
            return band
        fit, chunk, decoding, prefilling, budget = now
        if not decoding and not prefilling:
            return band
        return BatchedBand(band, fit, chunk, decoding, prefilling, budget)

    def stored_window(self, profile_id: str) -> list[list[Any]]:
        """What the last process learned for ``profile_id`` (its stored correction window)."""
        from app.profile_store import load_correction_window

        data_dir = self._data_dir()
        return load_correction_window(Path(data_dir), profile_id) if data_dir is not None else []

    def correction_state(self, profile_id: str) -> CorrectionState:
        """The online correction of ``profile_id`` as it stands (empty when never fed), at the
        machine speed of the newest answer it learned from (when the ``live_speed`` switch is on)."""
        return self.corrections.get(profile_id).state(None, bool(self._switches.live_speed),
                                                      residual_band=self._residual())

    def correction_summary(self, profile: Profile) -> dict[str, Any]:
        """The online correction of ``profile`` as a plan would get it now (at the machine speed
        of the latest engine steps when the ``live_speed`` switch is on: :meth:`live_speed`), as a
        dict, with ``groups``: what a plan alone and a plan beside a batch get
        (:meth:`latency_model.correction.OnlineCorrection.groups`), at that same speed."""
        correction = self.corrections.get(profile.id)
        use = bool(self._switches.live_speed)
        speed_now = self.live_speed(profile) if use else None
        return {**correction.state(speed_now, use, residual_band=self._residual()).to_dict(),
                "groups": correction.groups(speed_now, use)}

    def learn(self, p: Prepared, stats: GenerationStats | None, prefill_ms: float | None,
              span: tuple[float | None, float | None] = (None, None)) -> None:
        """Feed the measured prefill to the profile's online correction (and store its state).

        The pair is the uncorrected prediction's p50 for the tokens actually prefilled
        (prompt, cached), batch-aware as of the moment the request got the model (the
        fitted profile plus what the batch it joined adds: ``Prepared.granted_band``; a
        plan made on arrival, without late binding, may have seen another batch), and
        the measured time from the model granted to the first token; the p95 in force
        for it then gives the coverage figure; ``span``: ``(granted, last token)``
        ``perf_counter`` seconds of the answer, whose engine steps give the machine speed it
        ran at (:meth:`live_speed`); its group is that band's (:func:`group_of`). Fed whether
        or not the correction is applied, so switching it on starts from the machine as it is.
        """
        if stats is None or prefill_ms is None:
            return
        from app.profile_store import save_correction_state

        prompt, cached = int(stats.prompt_tokens), int(stats.cached_tokens or 0)
        prefix = min(int(p.prompt.scaffold_len), prompt)  # the engine chunks at the scaffold either way
        band = p.planner_profile if p.planner_profile is not None else p.profile
        fitted = p.granted_band if p.granted_band is not None else (
            band.profile if isinstance(band, CorrectedProfile) else band)
        fitted_p50 = float(fitted.predict_ttft_many([prompt], [cached], [max(prefix, cached)])[0][0])
        p95_now = float(band.predict_ttft_many([prompt], [cached], [max(prefix, cached)])[1][0])
        correction = self.corrections.get(p.profile.id)
        speed = self.live_speed(p.profile, span[0], span[1]) if span[0] is not None else None
        correction.observe(fitted_p50, prefill_ms, p95_now, speed, group_of(fitted))
        use = bool(self._switches.live_speed)
        speed_now = self.live_speed(p.profile) if use else None
        state = correction.state(speed_now, use, residual_band=self._residual())
        self._metrics.correction(state.factor, state.p95_multiplier, state.coverage, state.speed)
        data_dir = self._data_dir()
        if data_dir is None:
            return
        try:  # the groups at the same machine speed as the state, so the stored figures agree
            save_correction_state(data_dir, state, correction.window_pairs(),
                                  groups=correction.groups(speed_now, use))
        except OSError:
            log.warning("could not store the online correction of %s", p.profile.id, exc_info=True)
