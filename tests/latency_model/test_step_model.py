"""The mixed-step model: features, exact recovery, held-out scores, batched TTFT, calibration."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from foundation.errors import InvalidInput
from generation.engine.messages import Decoding, Prefilling, StepRecord
from latency_model.calibration import StepTimer, calibrate
from latency_model.grid import quick_grid, step_design
from latency_model.profile import Profile
from latency_model.step_model import (
    BatchedBand,
    StepFit,
    StepShape,
    batched_step_shapes,
    fit_steps,
    predict_batched_ttft_ms,
    prefill_schedule,
    step_features,
)
from tests.latency_model.conftest import IDENTITY, FakeTimer, no_cpu_probe

TRUE_STEP = {"a": 20.0, "b": 0.9, "s": 1.5, "g": 4e-4, "e": 2e-3, "h": 0.2}


def true_step_ms(shape: StepShape) -> float:
    x = step_features([shape])[0]
    return float(x @ np.array(list(TRUE_STEP.values())))


class FakeStepTimer(FakeTimer):
    """A FakeTimer that also times mixed steps by :data:`TRUE_STEP` times lognormal noise."""

    max_running = 8

    def __init__(self, **kw: object) -> None:
        super().__init__(identity={**IDENTITY, "engine": {"prefill_chunk": 256}}, **kw)

    def step_ms(self, prefill_tokens: int, prefill_pos: int, decode_contexts: list[int],
                prefill_needs_logits: bool = True) -> float:
        self.calls.append(("step", prefill_tokens, len(decode_contexts)))
        shape = StepShape.mixed(prefill_tokens, prefill_pos, decode_contexts, prefill_needs_logits)
        return true_step_ms(shape) * self._jitter()


def random_shapes(n: int, seed: int) -> list[StepShape]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        chunk = rng.choice([0, 7, 64, 256])
        decoders = rng.choice([1, 3, 8] if chunk == 0 else [0, 1, 3, 8])
        out.append(StepShape.mixed(chunk, rng.randint(0, 1500),
                                   [rng.randint(16, 2000) for _ in range(decoders)], rng.random() < 0.8))
    return out


def test_features_count_padded_rows_segments_scores_and_keys() -> None:
    shape = StepShape.mixed(10, 100, [50, 7])  # chunk of 10 at 100, two decode tokens
    x = step_features([shape])[0]
    assert x.tolist() == [1.0, 16.0, 3.0, 10 * 110 + 51 + 8, 110 + 51 + 8, 16.0]
    assert step_features([StepShape.mixed(10, 0, [], prefill_needs_logits=False)])[0][5] == 0.0


def test_noiseless_steps_recover_the_coefficients_and_score_zero() -> None:
    shapes = random_shapes(60, 1)
    ms = [true_step_ms(s) for s in shapes]
    fit = fit_steps(shapes, ms, list(range(len(shapes))))
    assert fit.loo_point_mape < 1e-6
    for k, v in TRUE_STEP.items():
        assert fit.coefficients[k] == pytest.approx(v, rel=1e-5, abs=1e-9)


def test_step_fit_round_trips_through_a_dict() -> None:
    shapes = random_shapes(30, 2)
    fit = fit_steps(shapes, [true_step_ms(s) for s in shapes], list(range(30)))
    again = StepFit.from_dict(fit.to_dict())
    assert again.predict_point_ms(shapes).tolist() == fit.predict_point_ms(shapes).tolist()
    with pytest.raises(InvalidInput):
        StepFit.from_dict({**fit.to_dict(), "form": "other"})


def test_prefill_schedule_follows_the_engines_chunks() -> None:
    assert prefill_schedule(600, 83, 83, 256) == [(256, 83), (256, 339), (5, 595)]
    assert prefill_schedule(600, 0, 83, 256) == [(83, 0), (256, 83), (256, 339), (5, 595)]
    assert prefill_schedule(300, 0, 0, 256) == [(256, 0), (44, 256)]


def test_running_answers_make_a_new_prefill_slower() -> None:
    shapes = random_shapes(60, 3)
    fit = fit_steps(shapes, [true_step_ms(s) for s in shapes], list(range(60)))
    kw = dict(prompt_tokens=900, cached_tokens=83, prefix_tokens=83, chunk_tokens=256)
    alone = predict_batched_ttft_ms(fit, decode_contexts=[], **kw)
    four = predict_batched_ttft_ms(fit, decode_contexts=[Decoding(500)] * 4, **kw)
    ahead = predict_batched_ttft_ms(fit, decode_contexts=[Decoding(500)] * 4,
                                    prefills_ahead=[Prefilling(600, 0)], **kw)
    assert alone[0] < four[0] < ahead[0] and four[0] <= four[1]


def test_decoders_that_finish_during_the_prefill_stop_costing() -> None:
    """A decoder with few steps left leaves the batch when they run out (it reaches
    max_new_tokens): the prediction is the one with it for those steps and without it after;
    an answer ahead decodes ``max_new - 1`` steps after its prefill (its first token comes from
    the prefill), and one with max_new 1 never joins the decoders."""
    shapes = random_shapes(60, 3)
    fit = fit_steps(shapes, [true_step_ms(s) for s in shapes], list(range(60)))
    kw = dict(prompt_tokens=1400, cached_tokens=83, prefix_tokens=83, chunk_tokens=256)  # 6 chunks
    alone = predict_batched_ttft_ms(fit, decode_contexts=[], **kw)
    forever = predict_batched_ttft_ms(fit, decode_contexts=[Decoding(500)] * 4, **kw)
    leaving = predict_batched_ttft_ms(fit, decode_contexts=[Decoding(500, 2)] * 4, **kw)
    staying = predict_batched_ttft_ms(fit, decode_contexts=[Decoding(500, 6)] * 4, **kw)
    assert alone[0] < leaving[0] < forever[0] and staying == forever
    # By hand: two steps with the four decoders, then four alone.
    sched = prefill_schedule(1400, 83, 83, 256)
    by_hand = sum(float(fit.predict_ms([StepShape.mixed(n, start, [500 + i] * 4 if i < 2 else [],
                                                        start + n == 1400)])[0][0])
                  for i, (n, start) in enumerate(sched))
    assert leaving[0] == pytest.approx(by_hand)
    one = predict_batched_ttft_ms(fit, decode_contexts=[], prefills_ahead=[Prefilling(300, 0, 1)], **kw)
    many = predict_batched_ttft_ms(fit, decode_contexts=[], prefills_ahead=[Prefilling(300, 0, 64)], **kw)
    unknown = predict_batched_ttft_ms(fit, decode_contexts=[], prefills_ahead=[Prefilling(300, 0)], **kw)
    assert one[0] < many[0] and many == unknown


def test_short_prefills_ahead_share_steps_within_the_step_token_budget() -> None:
    """Five 23-token prompts ahead (k = 0 answers with a cached scaffold) share one step, not
    five steps of their own, and then decode beside this answer's chunks (the engine packs chunks
    in admission order while they fit: tests/generation/test_scheduler.py checks the replay
    against the engine)."""
    shapes = random_shapes(60, 3)
    fit = fit_steps(shapes, [true_step_ms(s) for s in shapes], list(range(60)))
    kw = dict(prompt_tokens=600, cached_tokens=83, prefix_tokens=83, chunk_tokens=256)
    ahead = [Prefilling(23, 83, 32)] * 5
    packed = batched_step_shapes(decode_contexts=[], prefills_ahead=ahead, step_token_budget=256, **kw)
    one_each = batched_step_shapes(decode_contexts=[], prefills_ahead=ahead, **kw)
    assert len(one_each) == 5 + 3 and len(packed) == 1 + 3  # its 256-token chunk does not fit beside them
    assert packed[0].segments == ((23, 83),) * 5 and packed[0].logit_rows == 5
    assert packed[1].segments == ((1, 106),) * 5 + ((256, 83),) and packed[1].logit_rows == 5
    shared = predict_batched_ttft_ms(fit, decode_contexts=[], prefills_ahead=ahead,
                                     step_token_budget=256, **kw)
    apart = predict_batched_ttft_ms(fit, decode_contexts=[], prefills_ahead=ahead, **kw)
    assert shared[0] < apart[0]


def test_batched_band_adds_only_what_the_batch_costs(fitted_profile: Profile) -> None:
    shapes = random_shapes(60, 4)
    fit = fit_steps(shapes, [true_step_ms(s) for s in shapes], list(range(60)))
    empty = BatchedBand(fitted_profile, fit, 256, [])
    busy = BatchedBand(fitted_profile, fit, 256, [Decoding(300), Decoding(900)])
    n, c = [200, 800, 1500], [83, 83, 0]
    base = fitted_profile.predict_ttft_many(n, c, [83, 83, 83])
    assert np.allclose(empty.predict_ttft_many(n, c, [83, 83, 83])[0], base[0])
    p50, p95 = busy.predict_ttft_many(n, c, [83, 83, 83])
    assert np.all(p50 > base[0]) and np.all(p95 >= p50) and busy.id == fitted_profile.id


def test_step_design_is_seeded_and_respects_the_limits() -> None:
    grid = quick_grid(2048, [83], 256)
    a, b = step_design(grid, 1, 8, 256), step_design(grid, 1, 8, 256)
    assert a == b and len(a) == grid.step_points * grid.step_repeats + grid.step_fresh_points
    for (n, pos, ctx, _), _role in a:
        assert len(ctx) <= 8 and 0 <= n <= 256 and pos + n < 2048 and (n or ctx)
        assert all(16 <= x < 2048 for x in ctx)


def test_calibration_fits_and_stores_the_step_model() -> None:
    timer = FakeStepTimer(noise=0.02)
    assert isinstance(timer, StepTimer)
    profile = calibrate(timer, grid=quick_grid(2048, [83], 256), seed=4, progress=False,
                        cpu_probe=no_cpu_probe)
    fit = profile.step_fit
    assert fit is not None and fit.loo_point_mape < 0.05 and fit.fresh_points == 32
    assert fit.fresh_p95_coverage is not None and fit.fresh_p95_coverage >= 0.8
    assert profile.prefill_model == "chunked" or "chunked" in profile.form_comparison
    again = Profile.from_json(profile.to_json())
    assert again.step_fit is not None and again.id == profile.id
    assert math.isclose(again.step_fit.coefficients["b"], fit.coefficients["b"])


def test_a_timer_without_steps_gives_a_profile_without_a_step_model(fitted_profile: Profile) -> None:
    assert fitted_profile.step_fit is None and "step_model" not in fitted_profile.to_dict()


def test_machine_speed_is_the_median_step_ratio() -> None:
    from latency_model.step_model import MIN_SPEED_STEPS, machine_speed

    fit = StepFit(coefficients={"a": 5.0, "b": 0.5, "s": 1.0, "g": 0.0, "e": 0.01, "h": 0.2},
                  quantiles={}, in_sample_mape=0.0, loo_point_mape=0.0)
    shapes = [((1, 100 + i), (1, 400), (64, 83)) for i in range(20)]
    steps = [StepRecord(float(i), segs, 2, float(fit.predict_point_ms([StepShape(segs, 2)])[0]) * 1.4)
             for i, segs in enumerate(shapes)]
    steps[3] = StepRecord(3.0, steps[3].segments, 2, 1e6)  # one stalled step does not move the median
    steps.append(StepRecord(99.0, (), 0, 10.0))  # malformed: skipped
    got = machine_speed(fit, steps)
    assert got is not None and got[0] == pytest.approx(1.4) and got[1] == 20
    assert machine_speed(fit, steps[:MIN_SPEED_STEPS - 1]) is None


def test_machine_speed_weights_each_step_by_its_predicted_time() -> None:
    """Beside a CPU hog small decode steps slowed less than prefill chunks: the speed a plan
    scales by is the time-weighted one, not the count of steps."""
    from latency_model.step_model import machine_speed

    fit = StepFit(coefficients={"a": 5.0, "b": 0.5, "s": 1.0, "g": 0.0, "e": 0.01, "h": 0.2},
                  quantiles={}, in_sample_mape=0.0, loo_point_mape=0.0)
    decode = [((1, 300 + i),) for i in range(12)]  # 12 one-token steps, ~5.7 ms predicted
    chunks = [((256, 256 * i),) for i in range(4)]  # 4 chunk steps, ~130 ms predicted each

    def timed(segs: tuple[tuple[int, int], ...], rows: int, slow: float) -> StepRecord:
        return StepRecord(0.0, segs, rows, float(fit.predict_point_ms([StepShape(segs, rows)])[0]) * slow)

    steps = [timed(s, 1, 1.8) for s in decode] + [timed(s, 1, 2.2) for s in chunks]
    got = machine_speed(fit, steps)
    # 12 of 16 steps ran 1.8x (a plain median would say 1.8), but the chunks hold most time.
    assert got is not None and got == (pytest.approx(2.2), 16)


def test_a_scaffold_miss_is_priced_as_the_hit_plus_the_scaffold_steps() -> None:
    """A miss runs the scaffold's chunks, then a hit's steps: with a step model the predicted
    saving of a hit is the step model's time for those chunks, at every prompt length."""
    profile = calibrate(FakeStepTimer(noise=0.01), grid=quick_grid(2048, [83], 256), seed=5,
                        progress=False, cpu_probe=no_cpu_probe)
    fit = profile.step_fit
    assert fit is not None and profile.prefill_chunk_tokens == 256
    band = 1.0 + profile.prefill_quantiles.get("p50", 0.0)
    scaffold = float(fit.predict_point_ms([StepShape(((83, 0),), 1)])[0])
    for n in (100, 700, 2000):
        miss50, miss95 = profile.predict_ttft_ms(n, 0, 83)
        hit50, _ = profile.predict_ttft_ms(n, 83)
        assert miss50 - hit50 == pytest.approx(scaffold * band) and miss95 >= miss50
    # a 300-token scaffold with 40 cached runs two chunks: [40, 296) and [296, 300)
    two = fit.predict_point_ms([StepShape(((256, 40),), 0), StepShape(((4, 296),), 1)]).sum()
    miss50, _ = profile.predict_ttft_ms(1000, 40, 300)
    assert miss50 - profile.predict_ttft_ms(1000, 300)[0] == pytest.approx(float(two) * band)
    many50, _ = profile.predict_ttft_many([500, 500], [0, 83], [83, 83])
    assert many50[0] - many50[1] == pytest.approx(scaffold * band)
    # without a step model the prefill form prices the miss itself
    body = profile.to_dict()
    body.pop("step_model")
    plain = Profile.create(**body)
    assert plain.predict_ttft_ms(700, 0, 83)[0] == pytest.approx(
        float(plain.prefill_predictor.predict_ms([700], [0], [83])[0]) * band)
    assert plain.predict_ttft_ms(700, 0, 83)[0] != pytest.approx(profile.predict_ttft_ms(700, 0, 83)[0])
