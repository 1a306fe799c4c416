"""The pipeline plans a new answer against the running batch when the profile has a step model."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from app.answering.pipeline import AnswerPipeline
from generation.engine.messages import BatchSnapshot, Decoding, Prefilling, StepRecord
from latency_model.calibration import calibrate
from latency_model.grid import quick_grid
from latency_model.profile import Profile
from latency_model.step_model import BatchedBand, StepShape
from tests.latency_model.conftest import no_cpu_probe
from tests.latency_model.test_step_model import FakeStepTimer


class FakeEngine:
    def __init__(self, decoding: list[Any], prefilling: list[Any]) -> None:
        self.state = (decoding, prefilling)
        self.steps: list[StepRecord] = []

    def batch_snapshot(self) -> BatchSnapshot:
        """The engine's snapshot of ``state``: decoders as a context or ``(context, steps left)``,
        prefills as ``(tokens left, position, max_new[, order])``."""
        decoding, prefilling = self.state
        return BatchSnapshot(
            tuple(Decoding(d) if isinstance(d, int) else Decoding(*d) for d in decoding),
            tuple(Prefilling(*e) for e in prefilling))

    def recent_steps(self) -> list[StepRecord]:
        return list(self.steps)

    def run(self, fit: Any, speed: float, n: int = 32, t_end: float | None = None) -> None:
        """Log ``n`` decode steps of two answers that took ``speed`` x the step model's time."""
        t = time.perf_counter() if t_end is None else t_end
        for i in range(n):
            segs = ((1, 300 + i), (1, 700 + i))
            ms = float(fit.predict_point_ms([StepShape(segs, 2)])[0]) * speed
            self.steps.append(StepRecord(t - (n - i) * 1e-3, segs, 2, ms))


def ahead(band: Any) -> list[tuple[int, int, int | None]]:
    """``(tokens left, position, max_new)`` of each prefill ahead in a batched band."""
    return [(e.tokens_left, e.position, e.max_new) for e in band.prefills_ahead]


@pytest.fixture(scope="module")
def step_profile() -> Profile:
    return calibrate(FakeStepTimer(noise=0.01), grid=quick_grid(2048, [83], 256), seed=5,
                     progress=False, cpu_probe=no_cpu_probe)


def pipeline(engine: Any, online_correction: bool = True, live_speed: bool = True) -> AnswerPipeline:
    settings = SimpleNamespace(queue_max=4, late_binding=True, online_correction=online_correction,
                               correction_window=40, correction_live_speed=live_speed, otlp_endpoint=None)
    generator = SimpleNamespace(engine=engine, prefill_chunk=256)
    return AnswerPipeline(SimpleNamespace(settings=settings, generator=generator))  # type: ignore[arg-type]


def test_an_idle_engine_plans_as_before(step_profile: Profile) -> None:
    band, _ = pipeline(FakeEngine([], []), online_correction=False).bands.planner_profile(step_profile)
    assert band is step_profile
    corrected, _ = pipeline(FakeEngine([], [])).bands.planner_profile(step_profile)
    assert corrected.profile is step_profile


def test_running_answers_raise_the_planned_prefill(step_profile: Profile) -> None:
    band, state = pipeline(FakeEngine([400, 900, 1200], [(300, 83)]),
                           online_correction=False).bands.planner_profile(step_profile)
    assert isinstance(band, BatchedBand) and state is None
    alone, _ = pipeline(FakeEngine([], []), online_correction=False).bands.planner_profile(step_profile)
    busy_p50, busy_p95 = band.predict_ttft_many([600], [83], [83])
    alone_p50, _ = alone.predict_ttft_many([600], [83], [83])
    assert busy_p50[0] > alone_p50[0] and busy_p95[0] >= busy_p50[0]


def test_a_profile_without_a_step_model_ignores_the_batch(step_profile: Profile) -> None:
    body = step_profile.to_dict()
    body.pop("step_model")
    plain = Profile.create(**body)
    band, _ = pipeline(FakeEngine([400], []), online_correction=False).bands.planner_profile(plain)
    assert band is plain


def test_the_correction_sits_on_the_batch_aware_prediction(step_profile: Profile) -> None:
    from latency_model.correction import CorrectedProfile

    band, state = pipeline(FakeEngine([400, 900], [])).bands.planner_profile(step_profile)
    assert isinstance(band, CorrectedProfile) and isinstance(band.profile, BatchedBand)
    assert state is not None and not state.active
    off = pipeline(FakeEngine([400, 900], []), online_correction=False)
    plain, none = off.bands.planner_profile(step_profile)
    assert isinstance(plain, BatchedBand) and none is None


def test_answers_measured_as_the_batch_model_predicts_leave_the_factor_at_one(
        step_profile: Profile, tmp_path: Any) -> None:
    """The correction learns from the batch-aware prediction: a batch that slows prefill as
    the step model says is not read as a slower machine (and then added a second time)."""
    pipe = pipeline(FakeEngine([400, 900, 1200], [(300, 83)]))
    pipe.services.data_dir = tmp_path
    band, _ = pipe.bands.planner_profile(step_profile)
    batched_p50 = float(band.profile.predict_ttft_many([600], [83], [83])[0][0])
    alone_p50 = float(step_profile.predict_ttft_many([600], [83], [83])[0][0])
    assert batched_p50 > 1.2 * alone_p50
    p = SimpleNamespace(planner_profile=band, profile=step_profile, prompt=SimpleNamespace(scaffold_len=83),
                        granted_band=None)
    stats = SimpleNamespace(prompt_tokens=600, cached_tokens=83)
    for _ in range(8):
        pipe.bands.learn(p, stats, batched_p50)  # type: ignore[arg-type]
    state = pipe.bands.correction_state(step_profile.id)
    assert state.active and state.n == 8 and abs(state.factor - 1.0) < 1e-9


def test_the_correction_learns_against_the_batch_the_answer_joined(step_profile: Profile,
                                                                   tmp_path: Any) -> None:
    """Planned on arrival against an idle engine (no late binding), granted into a busy one:
    the pair the correction learns from is the prediction for the batch it joined."""
    idle, _ = pipeline(FakeEngine([], [])).bands.planner_profile(step_profile)
    pipe = pipeline(FakeEngine([400, 900, 1200], [(300, 83)]))
    pipe.services.data_dir = tmp_path
    granted = pipe.bands.batched(step_profile, step_profile)
    assert isinstance(granted, BatchedBand)
    joined_p50 = float(granted.predict_ttft_many([600], [83], [83])[0][0])
    p = SimpleNamespace(planner_profile=idle, profile=step_profile, prompt=SimpleNamespace(scaffold_len=83),
                        granted_band=granted)
    for _ in range(6):
        pipe.bands.learn(p, SimpleNamespace(prompt_tokens=600, cached_tokens=83), joined_p50)  # type: ignore[arg-type]
    assert abs(pipe.bands.correction_state(step_profile.id).factor - 1.0) < 1e-9


def test_an_answer_queued_in_the_engine_counts_as_a_prefill_ahead(step_profile: Profile) -> None:
    """An answer granted is in the engine's queue (its generator's ``stream()`` submitted it under
    the admit lock), so the next answer plans against it; once the engine drops it, it is no
    longer counted. The engine is the only place that says so."""
    engine = FakeEngine([], [(517, 83, 32, 0)])  # queued: not admitted, nothing computed
    pipe = pipeline(engine, online_correction=False)
    band = pipe.bands.batched(step_profile, step_profile)
    assert isinstance(band, BatchedBand) and ahead(band) == [(517, 83, 32)]
    engine.state = ([], [])
    assert pipe.bands.batched(step_profile, step_profile) is step_profile


def test_a_restarted_process_carries_on_from_the_stored_correction(step_profile: Profile,
                                                                   tmp_path: Any) -> None:
    """Answers learned by one process are in the next one's window (a CLI `ask` per process
    still reaches the correction's minimum), and a new profile (a calibration) starts empty."""
    first = pipeline(FakeEngine([], []))
    first.services.data_dir = tmp_path
    p = SimpleNamespace(planner_profile=step_profile, profile=step_profile,
                        prompt=SimpleNamespace(scaffold_len=83), granted_band=None)
    p50 = float(step_profile.predict_ttft_many([600], [83], [83])[0][0])
    for _ in range(6):
        first.bands.learn(p, SimpleNamespace(prompt_tokens=600, cached_tokens=83), 1.5 * p50)  # type: ignore[arg-type]
    second = pipeline(FakeEngine([], []))
    second.services.data_dir = tmp_path
    state = second.bands.correction_state(step_profile.id)
    assert state.n == 6 and state.active and state.factor == pytest.approx(1.5)
    assert second.bands.correction_state("sha256:" + "0" * 64).n == 0


def test_the_correction_follows_the_machine_speed_read_from_engine_steps(step_profile: Profile,
                                                                         tmp_path: Any) -> None:
    """Answers learned on a machine running steps at 1.0x their model, each measured 1.2x its
    prefill prediction; then the steps slow to 1.5x: the next plan's factor is 1.2 x 1.5 at
    once, before any slower answer has finished (off: the answers' median, 1.2)."""
    engine = FakeEngine([], [])
    fit = step_profile.step_fit
    pipe = pipeline(engine)
    pipe.services.data_dir = tmp_path
    p = SimpleNamespace(planner_profile=None, profile=step_profile, prompt=SimpleNamespace(scaffold_len=83),
                        granted_band=step_profile)
    p50 = float(step_profile.predict_ttft_many([600], [83], [83])[0][0])
    for _ in range(8):
        t0 = time.perf_counter()
        engine.run(fit, 1.0)
        pipe.bands.learn(p, SimpleNamespace(prompt_tokens=600, cached_tokens=83), 1.2 * p50,  # type: ignore[arg-type]
                    (t0 - 1.0, time.perf_counter()))
    _, state = pipe.bands.planner_profile(step_profile)
    assert state is not None and state.speed == pytest.approx(1.0) and state.factor == pytest.approx(1.2)
    engine.run(fit, 1.5)
    band, state = pipe.bands.planner_profile(step_profile)
    assert state is not None and state.speed == pytest.approx(1.5)
    assert state.factor == pytest.approx(1.8)
    assert band.predict_ttft_ms(600, 83)[0] == pytest.approx(1.8 * step_profile.predict_ttft_ms(600, 83)[0])
    pipe.live_speed = False
    _, off = pipe.bands.planner_profile(step_profile)
    assert off is not None and off.speed is None and off.factor == pytest.approx(1.2)


def test_an_idle_engine_reads_no_speed(step_profile: Profile) -> None:
    """Steps older than the horizon say nothing about the machine now; too few say nothing."""
    from app.answering.bands import SPEED_HORIZON_S

    engine = FakeEngine([], [])
    pipe = pipeline(engine)
    assert pipe.bands.live_speed(step_profile) is None
    engine.run(step_profile.step_fit, 1.3, n=4)
    assert pipe.bands.live_speed(step_profile) is None
    engine.steps.clear()
    engine.run(step_profile.step_fit, 1.3, t_end=time.perf_counter() - SPEED_HORIZON_S - 1.0)
    assert pipe.bands.live_speed(step_profile) is None
    engine.run(step_profile.step_fit, 1.3)
    assert pipe.bands.live_speed(step_profile) == pytest.approx(1.3)


def test_the_answer_shows_the_batch_its_plan_was_made_beside(step_profile: Profile) -> None:
    """``predicted.batch``: each running decoder's context and decode steps left, each prefill
    ahead's tokens left, position and max_new_tokens; None for a plan made alone."""
    from app.answering.bands import batch_of

    busy = pipeline(FakeEngine([(400, 5), (900, 30)], [(300, 83, 64)]))
    band, _ = busy.bands.planner_profile(step_profile)
    shown = batch_of(band)
    assert shown is not None and shown.model_dump() == {"decoding": [(400, 5), (900, 30)],
                                                       "prefilling": [(300, 83, 64)]}
    idle, _ = pipeline(FakeEngine([], [])).bands.planner_profile(step_profile)
    assert batch_of(idle) is None and batch_of(step_profile) is None
    leaving = pipeline(FakeEngine([(400, 1), (900, 1)], []), online_correction=False)
    staying = pipeline(FakeEngine([(400, 64), (900, 64)], []), online_correction=False)
    short = leaving.bands.planner_profile(step_profile)[0].predict_ttft_ms(1400, 83, 83)
    long = staying.bands.planner_profile(step_profile)[0].predict_ttft_ms(1400, 83, 83)
    assert short[0] < long[0]  # decoders about to finish cost one step, not the whole prefill


def test_answers_ahead_are_in_the_engines_prefill_order(step_profile: Profile) -> None:
    """Prefills ahead are priced in the engine's prefill order (the order their streams were
    started in), whatever order a snapshot lists them in."""
    engine = FakeEngine([], [(23, 83, 32, 6), (517, 83, 32, 5)])
    pipe = pipeline(engine, online_correction=False)
    band = pipe.bands.batched(step_profile, step_profile)
    assert isinstance(band, BatchedBand) and ahead(band) == [(517, 83, 32), (23, 83, 32)]


def test_before_any_answer_a_slower_machine_speed_scales_the_plan(step_profile: Profile,
                                                                   tmp_path: Any) -> None:
    """No answer learned yet (a new calibration), but the engine's steps run at 1.4x their
    model: the plan's p50 and p95 are the fitted ones x 1.4; steps at 0.8x leave them fitted."""
    engine = FakeEngine([], [])
    pipe = pipeline(engine)
    pipe.services.data_dir = tmp_path
    engine.run(step_profile.step_fit, 1.4)
    band, state = pipe.bands.planner_profile(step_profile)
    assert state is not None and state.n == 0 and state.active
    assert state.speed == pytest.approx(1.4) and state.factor == pytest.approx(1.4)
    fitted = step_profile.predict_ttft_ms(600, 83)
    assert band.predict_ttft_ms(600, 83) == pytest.approx((1.4 * fitted[0], 1.4 * fitted[1]))
    engine.steps.clear()
    engine.run(step_profile.step_fit, 0.8)
    band, state = pipe.bands.planner_profile(step_profile)
    assert state is not None and not state.active and state.factor == 1.0
    assert band.predict_ttft_ms(600, 83) == pytest.approx(fitted)
