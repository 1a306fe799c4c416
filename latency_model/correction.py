"""Online correction of a fitted profile: the prediction follows the machine as it is now.

A profile is fitted once, on a machine as busy as it was then. Every answer
then measures its prefill (the model granted to the first token); this module
keeps the last ``window`` pairs (fitted p50 prediction, measured time) and puts
two bounded terms on top of the fitted profile, which itself is never changed:

* ``factor``: the median of ``measured / predicted_p50`` over the window,
  clamped to ``[min_factor, max_factor]``; corrected p50 = fitted p50 x factor.
* ``p95_multiplier``: split-conformal (Vovk et al., *Algorithmic Learning in a
  Random World*, 2005; Angelopoulos & Bates, *A Gentle Introduction to Conformal
  Prediction*, 2021, section 1) over the scores ``measured / (predicted_p50 x
  factor)``: the ``ceil((n + 1) x 0.95)``-th smallest score, so that a new
  answer's measured prefill is below ``p50 x factor x multiplier`` with
  probability >= 0.95 when the window is exchangeable with it. With fewer than
  19 scores that rank is beyond the window; the fitted p95/p50 spread is used,
  widened to the largest score seen. Bounded by ``max_multiplier``.

  Without a machine speed the corrected p95 is never narrower than the fitted
  spread either (p95' >= fitted p95 x factor): a machine that drifts (a busy
  neighbour arriving, then going) is not exchangeable with the window, and a
  window of steady answers would otherwise put p95 a few percent above p50. On
  the CPU-hog run (docs/benchmarks.md, third run) this floor is what kept answers
  11-40 after the hog covered (replayed offline on its 50 answers: 100 % vs 80 % /
  90 % without). When the scores are speed-normalised (below) the drift is taken
  out of them, the window is exchangeable again and the conformal multiplier alone
  sets p95: on the fourth hog run the floor changed no answer's coverage (the
  multiplier was 1.15-1.21 against a fitted spread of 1.27). In the load grid's
  fifth run it made no measurable difference to the budget used (60 % with it
  off, 59 % with it on, docs/benchmarks.md): there the multiplier of a window
  mixing answers alone and beside a batch was wider than the fitted spread.
  Before the conformal rank is reached the floor applies either way.

  **The residual band** (``residual_band``, off by default: the rule above is ``False``). Once
  the scores in use hold :data:`GROUP_MIN` answers (the fewest whose 0.95 conformal rank is
  within them), p95 comes from the served answers' own residuals alone, with
  no fitted-spread floor, local or remote engine, speed or not, and per prompt size: a
  prediction takes the scores of the :data:`GROUP_MIN` answers nearest to it in log fitted p50
  (:func:`residual_multipliers`). The floor came from calibration on a shared VM, where the
  fitted p95 was 1.6-1.8x p50 at the prompt sizes that carry chunks while served prefills of
  those sizes spread 1.2-1.35x; and one multiplier over a window that mixes short prompts
  (k = 0, fixed costs, wide) with long ones (narrow) gave the long prompts the short prompts'
  width (docs/latency_model.md, "Where the band's width comes from"). The drift guard is a
  short-window conformal bound instead of the floor: the multiplier is at least the largest
  score of the newest :data:`GROUP_MIN` answers of that size, so one slow answer widens the next
  plan of its size, and the band narrows again once GROUP_MIN answers have followed it.
  Measured, not promised: replayed on the fleet's second run it covered 96-97 % of the prefills
  with chunks, on the third 88-93 %, where the earlier rule covered 98-100 %. Nor did a
  Mondrian band (each size class its own window of 40 or 80, with or without the drift guard)
  or a weighted conformal band per class (Barber et al. 2023, decay 0.97-0.995) hold 95 % on
  every engine of both runs; the only other rule that did (weighted, pooled) was wider
  (docs/latency_model.md, "Variants on both runs"). So the earlier rule is the default and the
  residual band is opt-in (``RAGBUDGET_CORRECTION_RESIDUAL_BAND``).

* ``speed``: how fast the machine runs engine steps now, against the mixed-step
  model (:func:`latency_model.step_model.machine_speed`), when the caller reads it.
  Each answer is stored with the speed of the steps it ran in; the factor is then
  learned on speed-normalised ratios ``measured / (predicted_p50 x speed_i)`` and
  applied as ``median x speed_now``, and the conformal scores are the normalised
  ratios. Finished answers come every few seconds and a median over 40 of them
  moves after ~20; steps come every ~100 ms, so a machine that slows by 40 % for ten
  seconds (a neighbour's burst, docs/benchmarks.md "The grid, third run") shows in
  the next plan, not twenty answers later. Without a speed (no step model, no
  recent steps, or fewer than ``min_samples`` answers stored with one) the factor
  is the plain median above.

* ``group`` (Mondrian conformal prediction: Vovk, Lindsay, Nouretdinov & Gammerman,
  *Mondrian confidence machine*, 2003; Vovk et al. 2005, section 4.5): each answer is stored
  with what its plan knew when it was made, ``"alone"`` (the engine ran nothing else) or
  ``"batched"`` (its prefill shared steps with other answers), and a plan in one group takes
  its factor and multiplier from that group's answers alone, once the group holds enough of
  them for the conformal rank (:data:`GROUP_MIN`); until then from the pooled window, its
  multiplier (and largest score) raised to the largest score the group's own answers have
  shown so far over the pooled factor, so the band covers at least what the group has
  measured (the first answers beside a batch, after a spell of answers alone, measured TTFT
  1.24-1.50x their plan's p50 where the pooled multiplier was 1.14-1.34:
  benchmarks/results/load-chunk64-800-retry.jsonl, closed-2). One pooled window mixes two spreads: a
  batched answer's prefill also pays for answers that arrive after its plan (its prediction
  cannot see them), and in the load grid's fifth run (docs/benchmarks.md) that mixture put
  every plan's p95 at 1.33-1.37x the measured TTFT, alone or not, where the fitted spread
  was 1.18-1.25x. Each group keeps its own ``window`` newest answers, so a busy spell does
  not push the answers alone out.

Until ``min_samples`` answers have been seen there is nothing to learn a factor
from: the fitted prediction is used unchanged (factor 1), unless the machine speed
read now is above 1 (the engine's steps run slower than at calibration, where the
profile and the step model were fitted together); then the fitted p50 and p95 are
both scaled by that speed (factor = speed, clamped to ``max_factor``). A speed
below 1 is not applied before answers confirm it: a faster machine only costs budget
left unused, a slower one misses. The first answers after a calibration on a machine
that has since got busier are thus planned against the machine as it is. A new
calibration is a new profile id and starts a fresh correction
(:class:`CorrectionRegistry`); so does :meth:`OnlineCorrection.reset`.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from foundation.errors import InvalidInput
from latency_model.residual_band import COVERAGE, GROUP_MIN, residual_multipliers

#: The groups answers are stored in (see the module docstring): planned with nothing else on
#: the engine, or beside a running batch.
ALONE = "alone"
BATCHED = "batched"
GROUPS = (ALONE, BATCHED)

#: One stored answer: fitted p50 ms, measured ms, covered, machine speed (or None), group (or None).
Pair = tuple[float, float, bool, float | None, str | None]


@dataclass(frozen=True)
class CorrectionState:
    """A snapshot: what the correction applies now and from how many answers.

    ``factor`` multiplies fitted p50 and p95; ``p95_multiplier`` (``None`` until
    enough answers) sets corrected p95 = corrected p50 x multiplier, replacing the
    fitted spread; ``n`` answers in the window (of ``window``); ``coverage`` share of
    the window's measured prefills at or below the p95 predicted for them at the
    time (``None`` when empty); ``speed`` the machine speed the factor was scaled to
    (``None``: the plain median, no step speed read); ``max_score`` the largest
    window score over the factor (the spread used before the conformal rank is reached).
    ``residuals``: with the residual band (:attr:`residual_band`), the ``(fitted p50 ms, score)``
    of every answer the band is learned from, oldest first, the score its (speed-normalised)
    ratio over the factor's median; ``None``: the fitted-spread rules. ``own_top``: the largest
    score the plan's group has shown when the band comes from the pooled window (1.0 otherwise).
    """

    profile_id: str
    factor: float
    p95_multiplier: float | None
    n: int
    window: int
    active: bool
    coverage: float | None
    speed: float | None = None
    max_score: float = 1.0
    group: str | None = None
    residuals: tuple[tuple[float, float], ...] | None = None
    own_top: float = 1.0

    @property
    def residual_band(self) -> bool:
        """True when p95 comes from the served answers' own residuals alone (see
        :func:`residual_multipliers`), with no fitted-spread floor."""
        return self.residuals is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field (``residuals`` as ``residual_band``, a bool)."""
        return {"profile_id": self.profile_id, "factor": self.factor,
                "p95_multiplier": self.p95_multiplier, "n": self.n, "window": self.window,
                "active": self.active, "coverage": self.coverage, "speed": self.speed,
                "max_score": self.max_score, "group": self.group,
                "residual_band": self.residual_band}


def _good_group(value: Any) -> str | None:
    """``value`` as a group name (one of :data:`GROUPS`), else ``None`` (pooled only)."""
    return value if isinstance(value, str) and value in GROUPS else None


def _good_speed(value: Any) -> float | None:
    """``value`` as a machine speed: a finite float > 0, else ``None``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and v > 0 else None


class OnlineCorrection:
    """The rolling correction of one profile (thread-safe).

    Args:
        profile_id: the profile it corrects.
        window: answers kept, per group (N >= 1); the pooled window is the newest N of all.
        min_samples: answers needed before it applies (>= 1, <= window).
        min_factor, max_factor: bounds of the multiplicative factor (0 < min <= 1 <= max).
        max_multiplier: bound of the p95/p50 multiplier (>= 1).
        residual_band: once the scores in use hold :data:`GROUP_MIN` answers, set p95 from
            their residuals alone, per prompt size, without the fitted-spread floor
            (:func:`residual_multipliers`); False (the default): the earlier rule (conformal
            multiplier over the whole window, floored at the fitted spread without a machine
            speed). A plan may override it (:meth:`state`).

    Raises:
        InvalidInput: a bound out of range.
    """

    def __init__(self, profile_id: str, *, window: int = 40, min_samples: int = 5,
                 min_factor: float = 0.25, max_factor: float = 4.0, max_multiplier: float = 4.0,
                 residual_band: bool = False) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise InvalidInput("need window >= 1 and 1 <= min_samples <= window", field="window")
        if not 0 < min_factor <= 1.0 <= max_factor or max_multiplier < 1.0:
            raise InvalidInput("need 0 < min_factor <= 1 <= max_factor and max_multiplier >= 1",
                               field="min_factor")
        self.profile_id = profile_id
        self.window = window
        self.min_samples = min_samples
        self.min_factor = min_factor
        self.max_factor = max_factor
        self.max_multiplier = max_multiplier
        self.residual_band = residual_band
        self._lock = threading.Lock()
        # (arrival number, pair) per group; None holds answers stored without a group.
        self._by_group: dict[str | None, deque[tuple[int, Pair]]] = {}
        self._seq = 0

    def _add(self, pair: Pair) -> None:
        """Store one pair in its group's window (under the lock)."""
        q = self._by_group.setdefault(pair[4], deque(maxlen=self.window))
        q.append((self._seq, pair))
        self._seq += 1

    def _all(self) -> list[Pair]:
        """Every stored pair of every group, oldest first (under the lock)."""
        return [pair for _, pair in sorted((e for q in self._by_group.values() for e in q),
                                           key=lambda e: e[0])]

    def reset(self) -> None:
        """Forget every answer: the fitted prediction applies unchanged again."""
        with self._lock:
            self._by_group.clear()

    def observe(self, predicted_p50_ms: float, measured_ms: float,
                predicted_p95_ms: float | None = None, speed: float | None = None,
                group: str | None = None) -> None:
        """Add one answer: the fitted (uncorrected) p50 prediction and the measured prefill, ms.

        ``predicted_p95_ms``: the p95 that was in force for it (for the coverage figure).
        ``speed``: the machine speed of the steps the answer ran in (see the module
        docstring; ``None``: not read). ``group``: what its plan knew (:data:`ALONE` or
        :data:`BATCHED`; anything else: pooled only). Non-finite or non-positive values are
        ignored (nothing to learn from); a bad speed is stored as ``None``.
        """
        if not (math.isfinite(predicted_p50_ms) and math.isfinite(measured_ms)
                and predicted_p50_ms > 0 and measured_ms > 0):
            return
        covered = predicted_p95_ms is None or measured_ms <= predicted_p95_ms
        with self._lock:
            self._add((float(predicted_p50_ms), float(measured_ms), bool(covered),
                       _good_speed(speed), _good_group(group)))

    def window_pairs(self) -> list[Pair]:
        """Every stored answer, oldest first: ``(fitted p50 ms, measured ms, covered, speed,
        group)``; up to ``window`` per group."""
        with self._lock:
            return self._all()

    def restore(self, pairs: Sequence[Sequence[Any]]) -> int:
        """Refill the windows from stored :meth:`window_pairs` (a process that starts again
        carries on from the machine as the last one saw it); returns how many were kept.
        Malformed or non-positive entries are skipped; each group keeps its newest
        ``window``. Entries of three or four fields (stored before speeds, or groups, were)
        restore with no speed, or no group."""
        good: list[Pair] = []
        for item in pairs:
            try:
                p50, measured, covered = float(item[0]), float(item[1]), bool(item[2])
                speed = _good_speed(item[3]) if len(item) > 3 else None
                group = _good_group(item[4]) if len(item) > 4 else None
            except (TypeError, ValueError, IndexError):
                continue
            if math.isfinite(p50) and math.isfinite(measured) and p50 > 0 and measured > 0:
                good.append((p50, measured, covered, speed, group))
        with self._lock:
            self._by_group.clear()
            for pair in good:
                self._add(pair)
            return sum(len(q) for q in self._by_group.values())

    def state(self, speed_now: float | None = None, use_speed: bool = True,
              group: str | None = None, residual_band: bool | None = None) -> CorrectionState:
        """The correction in force now (see :class:`CorrectionState`).

        ``speed_now``: the machine speed read from the latest engine steps (``None``: not
        read; then the newest stored answer's speed stands for it, as the machine last
        seen). The factor follows it when at least ``min_samples`` stored answers carry a
        speed; otherwise, or with ``use_speed`` False, it is the plain median of
        ``measured / predicted``. With fewer than ``min_samples`` answers a ``speed_now``
        above 1 alone is the factor (the stored speeds are not read then). ``group``: the
        plan's group (:data:`ALONE`, :data:`BATCHED`); its own answers set the factor and
        multiplier once it holds :data:`GROUP_MIN` of them, else (and with ``None``) the pooled
        window does: the newest ``window`` answers of every group, its multiplier no smaller
        than the largest score the group's own answers show over the pooled factor.
        ``residual_band``: the rule of :attr:`CorrectionState.residuals` (``None``: the
        correction's own setting); it applies once the scores in use number :data:`GROUP_MIN`.
        """
        group = _good_group(group)
        with self._lock:
            everything = self._all()
            own = [pair for _, pair in self._by_group.get(group, ())] if group is not None else []
        pooled = everything[-self.window:]
        n = len(pooled)
        coverage = sum(1 for pair in pooled if pair[2]) / n if n else None
        if n < self.min_samples:
            early = _good_speed(speed_now) if use_speed else None
            if early is not None and early > 1.0:
                # No answers yet to learn from, but the engine's steps say the machine is slower
                # than at calibration: scale the fitted band by that speed (see the docstring).
                factor = float(min(early, self.max_factor))
                return CorrectionState(self.profile_id, factor, None, n, self.window, True, coverage,
                                       speed=early, max_score=1.0)
            return CorrectionState(self.profile_id, 1.0, None, n, self.window, False, coverage)
        used_group = group if len(own) >= GROUP_MIN else None
        pairs = own if used_group is not None else pooled
        timed = [(p, m, s) for p, m, _, s, _ in pairs if s is not None] if use_speed else []
        speed = _good_speed(speed_now)
        if speed is None and use_speed:
            newest = [pair[3] for pair in pooled if pair[3] is not None]
            speed = newest[-1] if newest else None
        if speed is not None and len(timed) >= self.min_samples:
            ratios = np.array([m / (p * s) for p, m, s in timed])  # (n',) speed-normalised
            base = float(np.median(ratios))
            factor = float(np.clip(base * speed, self.min_factor, self.max_factor))
        else:
            speed = None
            ratios = np.array([pair[1] / pair[0] for pair in pairs])  # (n,)
            base = factor = float(np.clip(np.median(ratios), self.min_factor, self.max_factor))
        refs = ([p for p, _, _ in timed] if speed is not None
                else [pair[0] for pair in pairs])  # fitted p50 of each ratio, arrival order
        residuals = (tuple(zip(refs, (ratios / base).tolist(), strict=True))
                     if (self.residual_band if residual_band is None else residual_band)
                     and ratios.size >= GROUP_MIN else None)
        scores = np.sort(ratios / base)
        rank = math.ceil((scores.size + 1) * COVERAGE)
        mult: float | None = float(scores[rank - 1]) if rank <= scores.size else None
        max_score = float(scores[-1])
        if residuals is not None and mult is not None:
            # the per-size rule over the whole window: what a plan gets when all answers are one size
            mult = max(mult, float((ratios[-GROUP_MIN:] / base).max()))
        own_top = 1.0
        if used_group is None and own:
            # The plan's group is short of its own rank: the pooled band, widened to cover the
            # largest score the group's own answers have shown (same normalisation and base).
            mine = ([m / (p * s) for p, m, _, s, _ in own if s is not None] if speed is not None
                    else [m / p for p, m, _, _, _ in own])
            if mine:
                top = max(mine) / base
                own_top = top
                max_score = max(max_score, top)
                mult = max(mult, top) if mult is not None else None
        if mult is not None:
            mult = float(min(max(mult, 1.0), self.max_multiplier))
        return CorrectionState(self.profile_id, factor, mult, len(pairs), self.window, True, coverage,
                               speed=speed, max_score=max_score, group=used_group,
                               residuals=residuals, own_top=own_top)

    def groups(self, speed_now: float | None = None, use_speed: bool = True) -> dict[str, dict[str, Any]]:
        """Per group (:data:`GROUPS`): ``answers`` it holds, and the ``factor``,
        ``p95_multiplier`` and ``own`` (set by its own answers, else by the pooled window) a
        plan in that group gets now (:meth:`state`)."""
        with self._lock:
            held = {g: len(self._by_group.get(g, ())) for g in GROUPS}
        out: dict[str, dict[str, Any]] = {}
        for g in GROUPS:
            st = self.state(speed_now, use_speed, g)
            out[g] = {"answers": held[g], "factor": st.factor, "p95_multiplier": st.p95_multiplier,
                      "own": st.group == g}
        return out

    def apply(self, p50: ArrayLike, p95: ArrayLike,
              state: CorrectionState | None = None) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Corrected ``(p50, p95)`` arrays from the fitted ones (ms), under ``state`` (default: now).

        p50' = p50 x factor; p95' = max(p50' x multiplier, p95 x factor) when the window
        holds enough answers for the conformal rank (p50' x multiplier alone when the
        factor is speed-normalised, ``state.speed`` set: see the module docstring), else
        max(p95 x factor, p50' x largest score (``state.max_score``)); capped at p50' x
        ``max_multiplier`` and never below p50'. With the residual band (``state.residuals``):
        p95' = p50' x the multiplier of each prediction's size (:func:`residual_multipliers`,
        raised to ``state.own_top``), the fitted p95 unused.
        """
        st = state or self.state()
        a50 = np.asarray(p50, dtype=np.float64)
        a95 = np.asarray(p95, dtype=np.float64)
        if not st.active:
            return a50, a95
        c50 = a50 * st.factor
        if st.residuals is not None:
            mult = np.maximum(residual_multipliers(st.residuals, a50).reshape(a50.shape), st.own_top)
            c95 = c50 * np.minimum(mult, self.max_multiplier)
        elif st.p95_multiplier is not None:
            floor = c50 if st.speed is not None else a95 * st.factor
            c95 = np.minimum(np.maximum(c50 * st.p95_multiplier, floor), c50 * self.max_multiplier)
        else:
            c95 = np.minimum(np.maximum(a95 * st.factor, c50 * st.max_score), c50 * self.max_multiplier)
        return c50, np.maximum(c95, c50)


class CorrectedProfile:
    """A profile with its online correction applied to every prefill prediction.

    Has what the planner reads (``id``, ``source``, ``predict_ttft_many``,
    ``predict_ttft_ms``) and delegates everything else to the fitted profile.
    ``state`` is frozen at construction (under ``speed_now``, the machine speed read from
    the latest engine steps, ``use_speed``, the plan's ``group`` and ``residual_band``:
    :meth:`OnlineCorrection.state`), so one plan sees one correction.
    """

    def __init__(self, profile: Any, correction: OnlineCorrection, speed_now: float | None = None,
                 use_speed: bool = True, group: str | None = None,
                 residual_band: bool | None = None) -> None:
        self.profile = profile
        self.id: str = profile.id
        self.source: str = profile.source
        self.correction = correction
        self.state = correction.state(speed_now, use_speed, group, residual_band)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.profile, name)

    def predict_ttft_many(self, prompt_tokens: ArrayLike, cached_tokens: ArrayLike,
                          prefix_tokens: ArrayLike | None = None
                          ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """The fitted ``(p50, p95)`` arrays, ms, corrected (:meth:`OnlineCorrection.apply`);
        ``prefix_tokens`` as in :meth:`latency_model.profile.Profile.predict_ttft_many`."""
        p50, p95 = self.profile.predict_ttft_many(prompt_tokens, cached_tokens, prefix_tokens)
        return self.correction.apply(p50, p95, self.state)

    def predict_ttft_ms(self, prompt_tokens: int, cached_tokens: int) -> tuple[float, float]:
        """Corrected ``(p50, p95)`` of one prompt, ms."""
        p50, p95 = self.predict_ttft_many([prompt_tokens], [cached_tokens])
        return float(p50[0]), float(p95[0])


class CorrectionRegistry:
    """One :class:`OnlineCorrection` per profile id; a new profile (a calibration) starts fresh.

    Args:
        loader: ``profile_id -> stored window pairs`` (or None) seeding a correction on first
            use, so a restarted process keeps what the last one learned.
        **options: :class:`OnlineCorrection` keyword arguments.
    """

    def __init__(self, loader: Callable[[str], Sequence[Sequence[Any]] | None] | None = None,
                 **options: Any) -> None:
        self.loader = loader
        self.options = options
        self._lock = threading.Lock()
        self._by_id: dict[str, OnlineCorrection] = {}

    def get(self, profile_id: str) -> OnlineCorrection:
        """The correction of ``profile_id``: on first use, seeded by ``loader(profile_id)``
        (stored :meth:`OnlineCorrection.window_pairs`, when a loader was given), else empty."""
        with self._lock:
            c = self._by_id.get(profile_id)
            if c is None:
                c = self._by_id[profile_id] = OnlineCorrection(profile_id, **self.options)
                if self.loader is not None:
                    c.restore(self.loader(profile_id) or [])
            return c

    def known(self) -> Sequence[str]:
        """Profile ids with a correction."""
        with self._lock:
            return list(self._by_id)

    def reset(self, profile_id: str | None = None) -> None:
        """Drop the correction of ``profile_id`` (every one when ``None``)."""
        with self._lock:
            if profile_id is None:
                self._by_id.clear()
            else:
                self._by_id.pop(profile_id, None)
