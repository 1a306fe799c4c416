"""The TTFT budget under load, with a deterministic fake generator (fixed step times).

:class:`tests.api.fakes.StepGenerator` holds the model for a fixed schedule (the
fake timer's true prefill cost, then 20 ms decode steps), and the stored profile
is fitted on that timer, so the predicted wait can be checked against the
schedule. The checks are on choices and counts, never on wall-clock limits:
a request that waited gets a smaller k than one that did not; ``reject``
answers 503 ``budget_unreachable`` and writes no receipt; the online correction
is bounded and starts afresh with a new calibration.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from app.profile_store import save_profile
from foundation.db import read_session
from latency_model.calibration import calibrate
from latency_model.correction import (
    ALONE,
    BATCHED,
    GROUP_MIN,
    CorrectedProfile,
    CorrectionRegistry,
    OnlineCorrection,
)
from latency_model.grid import quick_grid
from receipts.models import ReceiptRow
from tests.api.conftest import KeyedApp, api_settings, start_keyed_app
from tests.api.fakes import CharTokenizer, StepGenerator
from tests.latency_model.conftest import FakeTimer

# Six documents of one chunk each (~120 character-tokens: ~110 ms of fake prefill each).
DOCS = {f"pump-{i}.txt": (f"Pump {i} of the zebrafish circulation is painted vermilion and runs at "
                          f"{i + 3} litres per minute on the night shift, checked weekly.")
        for i in range(6)}
Q = "What colour is the zebrafish pump?"
MAX_NEW = 4


def _receipts(app: KeyedApp) -> int:
    from sqlalchemy import func, select

    with read_session(app.services.engine) as s:
        return int(s.scalar(select(func.count()).select_from(ReceiptRow)) or 0)


@pytest.fixture
def loaded(tmp_path_factory: pytest.TempPathFactory, api_profile: Any) -> Iterator[tuple[KeyedApp, Any]]:
    gate = threading.Event()
    gate.set()
    gen = StepGenerator(CharTokenizer(), gate=gate)
    app = start_keyed_app(api_settings(tmp_path_factory.mktemp("load"), retrieval_candidates=6,
                                       default_max_new_tokens=MAX_NEW, queue_max=4, generator_max_running=1,
                                       auth_enabled=False), api_profile, gen)
    with app.client:
        for doc_id, text in DOCS.items():
            r = app.client.post("/v1/documents", json={"id": doc_id, "text": text})
            assert r.status_code == 201, r.text
        app.client.app.state.pipeline.warm()  # type: ignore[attr-defined]
        yield app, gen
    app.services.close()


def _ask(app: KeyedApp, budget: float, **extra: Any) -> Any:
    return app.client.post("/v1/answer", json={"question": Q, "ttft_budget_ms": budget, **extra})


def _hold(app: KeyedApp, gen: StepGenerator) -> tuple[threading.Thread, list[Any]]:
    """Start a short answer (k <= 1, one token) that holds the model at the gate until it is set."""
    gen.gate.clear()  # type: ignore[union-attr]
    gen.started.clear()
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(_ask(app, 60_000, k_max=1, max_new_tokens=1)))
    t.start()
    assert gen.started.wait(10)
    return t, out


def _wait_depth(app: KeyedApp, depth: int) -> None:
    queue = app.client.app.state.pipeline.queue  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while queue.depth < depth:
        assert time.monotonic() < deadline, "the request never queued"
        time.sleep(0.005)


def _ask_behind_a_held_answer(app: KeyedApp, gen: StepGenerator, budget: float, hold_s: float = 0.0,
                              while_queued: Any = None, **extra: Any) -> tuple[Any, Any, Any]:
    """Hold the model with a short answer (:func:`_hold`), ask behind it, keep the model busy
    ``hold_s`` seconds once the request has queued (calling ``while_queued()`` then), release.

    Returns ``(the holder's response, the queued request's response, while_queued's result)``.
    """
    holder, held = _hold(app, gen)
    out: list[Any] = []
    waiter = threading.Thread(target=lambda: out.append(_ask(app, budget, **extra)))
    waiter.start()
    seen = None
    try:
        _wait_depth(app, 1)
        seen = while_queued() if while_queued is not None else None
        time.sleep(hold_s)
    finally:
        gen.gate.set()  # type: ignore[union-attr]
    holder.join(30)
    waiter.join(30)
    return held[0], out[0], seen


def test_after_a_wait_the_plan_picks_a_smaller_k(loaded: tuple[KeyedApp, Any]) -> None:
    app, gen = loaded
    alone = _ask(app, 1500).json()
    assert alone["chosen_k"] >= 2 and alone["predicted"]["late_bound"] is True

    # The model stays busy 1 s: two thirds of the budget gone before prefill.
    late = _ask_behind_a_held_answer(app, gen, 1500, hold_s=1.0)[1].json()
    assert late["timings"]["queue_ms"] >= 1000
    assert late["chosen_k"] < alone["chosen_k"]
    # The plan counted the time actually spent when it chose k.
    assert late["predicted"]["overhead_ms"] >= late["timings"]["queue_ms"]


def test_without_late_binding_the_wait_is_unseen(loaded: tuple[KeyedApp, Any]) -> None:
    app, gen = loaded
    pipeline = app.client.app.state.pipeline  # type: ignore[attr-defined]
    pipeline.late_binding = False
    alone = _ask(app, 1500).json()
    late = _ask_behind_a_held_answer(app, gen, 1500, hold_s=1.0)[1].json()
    assert late["predicted"]["late_bound"] is False
    # Chosen on arrival, as if the model were free: the plan never counted the wait.
    assert late["predicted"]["overhead_ms"] < late["timings"]["queue_ms"]
    assert late["chosen_k"] >= alone["chosen_k"] - 1


def test_predicted_wait_matches_the_fake_schedule(loaded: tuple[KeyedApp, Any]) -> None:
    """Running answer held before its prefill + one waiting answer: the advised wait is the
    fake's schedule for both (prefill + max_new_tokens - 1 steps each), within the profile's fit."""
    app, gen = loaded
    held, queued, advice = _ask_behind_a_held_answer(
        app, gen, 60_000,
        while_queued=lambda: app.client.post("/v1/advise", json={"question": Q,
                                                                  "ttft_budget_ms": 60_000}).json())
    first, second = held.json(), queued.json()
    expected = sum(gen.schedule_ms(a["tokens"]["prompt"], a["tokens"]["cached"], a["tokens"]["output"])
                   for a in (first, second))
    assert advice["queue_depth"] == 1
    assert advice["predicted_wait_ms"] == pytest.approx(expected, rel=0.1)
    # The waiter itself saw only the running answer ahead of it.
    alone = gen.schedule_ms(first["tokens"]["prompt"], first["tokens"]["cached"], 1)
    assert second["predicted"]["wait_ms"] == pytest.approx(alone, rel=0.1)
    # The advised plan counts that wait in its overhead.
    assert advice["plan"]["overhead_ms"] >= advice["predicted_wait_ms"]


def test_reject_answers_503_inviting_no_retry_and_writes_no_receipt(loaded: tuple[KeyedApp, Any]) -> None:
    app, _ = loaded
    before = _receipts(app)
    r = _ask(app, 5, on_budget_miss="reject")  # k = 0 alone needs ~60 ms, on an idle model
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "budget_unreachable"
    assert err["details"]["predicted_ttft_ms"] > 5
    # No wait helps: nothing invites a retry (the openai client obeys x-should-retry).
    assert err["details"]["retryable"] is False and err["details"]["idle_ttft_ms"] > 5
    assert r.headers["x-should-retry"] == "false" and "Retry-After" not in r.headers
    assert _receipts(app) == before
    # The default (answer) answers it, flagged.
    a = _ask(app, 5).json()
    assert a["binding"] == "nothing_fits" and a["chosen_k"] == 0 and a["receipt_id"]
    assert a["within_budget"] is False and a["budget_miss_cause"] in ("overhead", "queue", "prefill")
    assert _receipts(app) == before + 1
    metrics = app.client.get("/metrics").text
    assert 'ragbudget_budget_rejections_total{where="arrival"} 1.0' in metrics
    assert "ragbudget_budget_misses_by_cause_total" in metrics


def test_reject_never_refuses_what_k0_can_make(loaded: tuple[KeyedApp, Any]) -> None:
    app, _ = loaded
    advice = app.client.post("/v1/advise", json={"question": Q, "ttft_budget_ms": 60_000}).json()
    k0 = advice["plan"]["rows"][0]["ttft_p95_ms"] + advice["plan"]["overhead_ms"]
    r = _ask(app, 2 * k0 + 50, on_budget_miss="reject")
    assert r.status_code == 200, r.text


def test_reject_after_the_wait_when_the_wait_ate_the_budget(loaded: tuple[KeyedApp, Any]) -> None:
    app, gen = loaded
    before = _receipts(app)
    # The holder is predicted short, but held at the gate.
    r = _ask_behind_a_held_answer(app, gen, 400, hold_s=0.5, on_budget_miss="reject")[1]
    assert r.status_code == 503 and r.json()["error"]["code"] == "budget_unreachable"
    assert r.json()["error"]["details"]["where"] == "granted"
    # The wait ate the budget, not k = 0 itself: a retry on a quieter model can make it.
    assert r.json()["error"]["details"]["retryable"] is True
    assert r.headers["x-should-retry"] == "true" and int(r.headers["Retry-After"]) >= 1
    assert _receipts(app) == before + 1  # the holder's only
    # Neither the refused request nor the one answered is still counted as arrived.
    assert app.client.app.state.pipeline.arrivals.waiting() == []  # type: ignore[attr-defined]


def test_openai_route_takes_on_budget_miss_from_body_or_header(loaded: tuple[KeyedApp, Any]) -> None:
    app, gen = loaded
    body = {"model": gen.identity["model_id"], "messages": [{"role": "user", "content": Q}],
            "ttft_budget_ms": 5}
    r = app.client.post("/v1/chat/completions", json={**body, "on_budget_miss": "reject"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "budget_unreachable"
    assert r.json()["error"]["type"] == "server_error" and r.headers["x-should-retry"] == "false"
    r = app.client.post("/v1/chat/completions", json=body,
                        headers={"X-Ragbudget-On-Budget-Miss": "reject"})
    assert r.status_code == 503
    r = app.client.post("/v1/chat/completions", json={**body, "on_budget_miss": "answer"},
                        headers={"X-Ragbudget-On-Budget-Miss": "reject"})  # the body wins
    assert r.status_code == 200
    assert r.json()["ragbudget"]["binding"] == "nothing_fits"
    r = app.client.post("/v1/chat/completions", json=body,
                        headers={"X-Ragbudget-On-Budget-Miss": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_on_budget_miss"


def test_correction_follows_a_slower_machine_and_restarts_with_calibration(
        loaded: tuple[KeyedApp, Any]) -> None:
    app, gen = loaded
    pipeline = app.client.app.state.pipeline  # type: ignore[attr-defined]
    gen.slow = 2.0  # the machine got twice as slow after calibration
    answers = [_ask(app, 60_000).json() for _ in range(8)]
    profile_id = answers[-1]["predicted"]["profile_id"]
    state = pipeline.bands.correction_state(profile_id)
    assert state.active and 1.6 <= state.factor <= 2.4
    assert answers[-1]["predicted"]["correction_factor"] == pytest.approx(state.factor, rel=0.3)
    shown = app.client.get(f"/v1/latency/profiles/{profile_id}", params={"samples": False}).json()
    assert shown["correction"]["n"] == 8 and shown["correction"]["factor"] == state.factor
    # Nothing else ran on the engine: every answer is learned, and shown, as a plan alone; 8
    # answers are too few for the group's own band, so its plans use the pooled window.
    assert [pair[4] for pair in pipeline.bands.corrections.get(profile_id).window_pairs()] == ["alone"] * 8
    assert shown["correction"]["groups"]["alone"] == {
        "answers": 8, "factor": state.factor, "p95_multiplier": None, "own": False}
    assert shown["correction"]["groups"]["batched"]["answers"] == 0
    assert answers[-1]["predicted"]["correction_group"] is None
    # The fitted coefficients were never rewritten.
    stored = pipeline.profile()
    assert stored.id == profile_id
    # A new calibration is a new profile: its correction starts empty.
    fresh = calibrate(FakeTimer(seed=11), grid=quick_grid(8192, [200]), seed=5, progress=False)
    save_profile(app.services.engine, app.services.data_dir, fresh)
    a = _ask(app, 60_000).json()
    assert a["predicted"]["profile_id"] == fresh.id
    assert a["predicted"]["correction_factor"] == 1.0
    assert pipeline.bands.correction_state(fresh.id).n == 1


def test_online_correction_is_bounded() -> None:
    c = OnlineCorrection("p", window=10, min_samples=3, max_factor=4.0, min_factor=0.25)
    assert c.state().factor == 1.0 and not c.state().active
    for _ in range(10):
        c.observe(100.0, 10_000.0)  # 100x slower than predicted
    assert c.state().factor == 4.0
    for _ in range(10):
        c.observe(100.0, 0.01)  # the window forgets: now far quicker
    assert c.state().factor == 0.25
    c.observe(float("nan"), 5.0)
    c.observe(100.0, -1.0)
    assert c.state().n == 10  # nonsense is ignored
    c.reset()
    assert c.state().n == 0 and c.state().factor == 1.0


def test_before_enough_answers_a_slower_machine_speed_scales_the_fitted_band() -> None:
    """With fewer than min_samples answers, a machine speed above 1 read from the engine's
    steps scales the fitted p50 and p95 by it (bounded); a speed of 1 or below, no speed, or
    the speed switch off leave the fitted band as it is."""
    c = OnlineCorrection("p", window=40, min_samples=5, max_factor=4.0)
    st = c.state(1.5)
    assert st.active and st.factor == pytest.approx(1.5) and st.speed == pytest.approx(1.5)
    assert st.n == 0 and st.p95_multiplier is None
    p50, p95 = c.apply([100.0, 200.0], [130.0, 260.0], st)
    assert list(p50) == pytest.approx([150.0, 300.0]) and list(p95) == pytest.approx([195.0, 390.0])
    assert c.state(9.0).factor == 4.0  # bounded like any factor
    for quiet in (1.0, 0.7, None, float("nan")):
        off = c.state(quiet)
        assert not off.active and off.factor == 1.0 and off.speed is None
        assert c.apply([100.0], [130.0], off)[1][0] == 130.0
    assert not c.state(1.5, use_speed=False).active
    for _ in range(4):
        c.observe(100.0, 100.0, speed=1.5)
    assert c.state(2.0).factor == pytest.approx(2.0)  # 4 answers: still the speed alone
    c.observe(100.0, 100.0, speed=1.5)
    # From the fifth answer the window's speed-normalised median (1/1.5) is learned.
    assert c.state(2.0).factor == pytest.approx(2.0 / 1.5)


def test_conformal_multiplier_covers_the_window() -> None:
    c = OnlineCorrection("p", window=40, min_samples=5)
    ratios = [1.0 + 0.02 * i for i in range(40)]  # 1.00 .. 1.78
    for r in ratios:
        c.observe(100.0, 100.0 * r)
    st = c.state()
    assert st.p95_multiplier is not None
    p50, p95 = c.apply([100.0], [110.0], st)
    covered = sum(100.0 * r <= p95[0] for r in ratios) / len(ratios)
    assert covered >= 0.95
    assert p50[0] == pytest.approx(100.0 * st.factor)


def test_under_the_fitted_floor_rule_a_steady_window_keeps_the_fitted_spread() -> None:
    """The earlier rule (``residual_band=False``): forty answers measured at exactly 1.5x, the
    conformal multiplier is 1.0, but the p95 keeps the fitted p95/p50 spread."""
    c = OnlineCorrection("p", window=40, min_samples=5, residual_band=False)
    for _ in range(40):
        c.observe(100.0, 150.0)
    st = c.state()
    assert st.factor == pytest.approx(1.5) and st.p95_multiplier == pytest.approx(1.0)
    p50, p95 = c.apply([100.0], [112.0], st)
    assert p50[0] == pytest.approx(150.0) and p95[0] == pytest.approx(112.0 * 1.5)


def test_speed_normalised_scores_set_p95_by_the_conformal_multiplier_alone() -> None:
    """With the drift taken out by the machine speed, the window is exchangeable: p95 is the
    conformal multiplier over p50, narrower than the fitted spread when the answers are;
    before the conformal rank is reached the fitted spread still applies."""
    ratios = [1.0 + 0.005 * i for i in range(40)]  # 1.000 .. 1.195: tighter than the 1.3 spread
    c = OnlineCorrection("p", window=40, min_samples=5)
    for i, r in enumerate(ratios):
        speed = 1.0 if i % 2 else 1.6  # a machine that keeps changing speed
        c.observe(100.0, 100.0 * r * speed, speed=speed)
    st = c.state(1.6)
    assert st.speed == pytest.approx(1.6) and st.p95_multiplier is not None
    p50, p95 = c.apply([100.0], [130.0], st)
    assert p95[0] == pytest.approx(p50[0] * st.p95_multiplier) and p95[0] < 130.0 * st.factor
    covered = sum(100.0 * r * 1.6 <= p95[0] for r in ratios) / len(ratios)
    assert covered >= 0.95
    few = OnlineCorrection("p", window=40, min_samples=5)
    for r in ratios[:10]:
        few.observe(100.0, 100.0 * r, speed=1.0)
    st = few.state(1.0)
    assert st.p95_multiplier is None and st.speed == pytest.approx(1.0)
    assert few.apply([100.0], [130.0], st)[1][0] == pytest.approx(130.0 * st.factor)


def test_corrected_profile_and_registry(api_profile: Any) -> None:
    reg = CorrectionRegistry(window=5, min_samples=1)
    c = reg.get(api_profile.id)
    c.observe(100.0, 300.0)
    corrected = CorrectedProfile(api_profile, c)
    p50, _ = api_profile.predict_ttft_ms(500, 0)
    c50, c95 = corrected.predict_ttft_ms(500, 0)
    assert c50 == pytest.approx(3 * p50) and c95 >= c50
    assert corrected.id == api_profile.id and corrected.source == api_profile.source
    reg.reset(api_profile.id)
    assert reg.get(api_profile.id).state().n == 0


def test_speed_normalised_correction() -> None:
    """Answers stored with the machine speed they ran at: the factor is their speed-normalised
    median scaled to the speed now; without a speed now, the newest answer's speed stands."""
    c = OnlineCorrection("p", window=40, min_samples=5)
    for i in range(10):
        speed = 1.0 if i < 5 else 2.0
        c.observe(100.0, 120.0 * speed, speed=speed)  # 1.2x the prediction at every speed
    assert c.state(1.0).factor == pytest.approx(1.2)
    assert c.state(1.5).factor == pytest.approx(1.8) and c.state(1.5).speed == pytest.approx(1.5)
    assert c.state().factor == pytest.approx(2.4) and c.state().speed == pytest.approx(2.0)
    # The normalised scores are all 1: the spread the speed explains is not p95 spread.
    assert c.state(1.0).max_score == pytest.approx(1.0)
    plain = OnlineCorrection("p", window=40, min_samples=5)
    for i in range(10):
        plain.observe(100.0, 120.0 * (1.0 if i < 5 else 2.0))
    st = plain.state(1.5)  # no stored speeds: the plain median, the speed unused
    assert st.speed is None and st.factor == pytest.approx(1.8) and st.max_score == pytest.approx(240 / 180)


def test_stored_windows_restore_with_and_without_speeds() -> None:
    c = OnlineCorrection("p", window=4, min_samples=1)
    assert c.restore([[100.0, 150.0, True], [100.0, 130.0, False, 1.3], [100.0, 90.0, True, "x"],
                      [1.0], [100.0, -1.0, True, 1.0]]) == 3
    assert [pair[3] for pair in c.window_pairs()] == [None, 1.3, None]
    c.observe(100.0, 120.0, 130.0, speed=float("nan"))
    assert c.window_pairs()[-1] == (100.0, 120.0, True, None, None)
    # Groups round-trip; an unknown group is stored pooled only.
    g = OnlineCorrection("p", window=4, min_samples=1)
    assert g.restore([[100.0, 150.0, True, 1.0, "alone"], [100.0, 130.0, True, None, "batched"],
                      [100.0, 110.0, True, None, "elsewhere"]]) == 3
    assert [pair[4] for pair in g.window_pairs()] == ["alone", "batched", None]


def test_each_group_of_plans_gets_its_own_conformal_band() -> None:
    """Mondrian conformal: answers planned alone measure within 1.00-1.10x their prediction,
    answers beside a batch 0.6-1.9x. A plan alone gets a band from the answers alone (narrow,
    still covering them); a batched plan from the batched ones (wide, covering them); the
    pooled window covers neither group's width correctly. Until a group holds GROUP_MIN
    answers its plans use the pooled window, widened to cover the group's own answers."""
    rng = random.Random(3)
    alone = [1.0 + 0.1 * rng.random() for _ in range(40)]
    batched = [0.6 + 1.3 * rng.random() for _ in range(40)]
    c = OnlineCorrection("p", window=40, min_samples=5)
    for i in range(GROUP_MIN - 1):  # one short of its own band: alone plans use the pool
        c.observe(100.0, 100.0 * alone[i], group=ALONE)
        c.observe(100.0, 100.0 * batched[i], group=BATCHED)
    pooled = c.state()
    assert c.state(group=ALONE).group is None
    assert c.state(group=ALONE).p95_multiplier == pooled.p95_multiplier  # its answers are all inside
    short = c.state(group=BATCHED)
    assert short.group is None and short.factor == pooled.factor
    widest = max(batched[: GROUP_MIN - 1]) / pooled.factor
    assert pooled.p95_multiplier is not None and pooled.p95_multiplier < widest
    assert short.p95_multiplier == pytest.approx(widest)  # covers every batched answer so far
    _, p95 = c.apply([100.0], [100.0], short)
    assert all(100.0 * r <= p95[0] + 1e-9 for r in batched[: GROUP_MIN - 1])
    for i in range(GROUP_MIN - 1, 40):
        c.observe(100.0, 100.0 * alone[i], group=ALONE)
        c.observe(100.0, 100.0 * batched[i], group=BATCHED)
    assert len(c.window_pairs()) == 80  # 40 per group
    by_group = {}
    for name, ratios in ((ALONE, alone), (BATCHED, batched)):
        st = c.state(group=name)
        assert st.group == name and st.n == 40
        _, p95 = c.apply([100.0], [100.0], st)
        by_group[name] = p95[0]
        assert sum(100.0 * r <= p95[0] for r in ratios) / 40 >= 0.95
    assert by_group[ALONE] < 115.0 < 170.0 < by_group[BATCHED]
    groups = c.groups()
    assert groups[ALONE]["own"] and groups[ALONE]["answers"] == 40
    assert groups[ALONE]["p95_multiplier"] < groups[BATCHED]["p95_multiplier"]
    pooled_p95 = c.apply([100.0], [100.0], c.state())[1][0]
    assert by_group[ALONE] < pooled_p95 < by_group[BATCHED]


def test_a_miss_is_blamed_on_the_larger_part_of_its_overrun() -> None:
    """The overrun is (time spent + planned prefill p95 - budget) + (prefill - p95): the cause
    is the larger part, ``prefill`` whenever the plan still fitted once the model was free."""
    from types import SimpleNamespace

    from app.answering.receipt import _miss_cause

    p = SimpleNamespace(budget_ms=1200.0)
    row = SimpleNamespace(ttft_p95_ms=1168.0)
    # Fitted at grant (20 + 1168 <= 1200): a prefill past its p95 is the cause.
    assert _miss_cause(p, row, 20.0, 0.0, 1250.0) == "prefill"
    # 1 ms over at grant, then 249 ms past the p95 (the main job's first answer): prefill.
    assert _miss_cause(p, row, 33.0, 0.0, 1417.0) == "prefill"
    # 300 ms over at grant, prefill 10 ms past its p95: what came before prefill.
    assert _miss_cause(p, row, 332.0, 300.0, 1178.0) == "queue"
    assert _miss_cause(p, row, 332.0, 5.0, 1178.0) == "overhead"
    # Prefill unknown: only the part before prefill can be read.
    assert _miss_cause(p, row, 332.0, 5.0, None) == "overhead"
    assert _miss_cause(p, None, 332.0, 5.0, 1178.0) == "overhead"
