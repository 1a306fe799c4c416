"""Calibration: time real prefills and decode steps over a grid, fit a profile.

The room's edge: this module drives a :class:`PrefillTimer` (the local
generator, a remote engine measured from the client side, or a fake in tests)
and reads the clock only through it. The grid is crossed (prompt lengths x
cached-prefix lengths), repeated, shuffled with a seeded RNG so slow drifts
(thermal, other processes) spread over all points instead of biasing one
length, preceded by warm-up calls, and followed by fresh points at random
lengths that are measured in the same interleaved run but never fitted.
Every raw sample, warm-ups included, is kept in the profile.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np

from foundation.errors import BackendError, InvalidInput
from foundation.provenance import software_versions, utc_now_iso
from latency_model.fitting import coverage, finite_or_none, fit_decode, fit_prefill, mape, select_prefill
from latency_model.profile import Profile
from latency_model.roofline import build_prior, datasheet_peaks

QUICK_MAX_PROMPT_TOKENS = 2048
# Prompt lengths, roughly geometric so the bends show; some deliberately not multiples of 8
# (real prompts have arbitrary lengths and GEMM kernels can favour aligned sizes).
# Short lengths are dense: they cost little, and their kernels' shape effects (+-10 %) must be
# in the fit set for the band to cover them.
QUICK_LADDER = (8, 13, 29, 45, 67, 96, 160, 251, 512, 765, 1024, 1531, 2048)
FULL_LADDER = (8, 13, 29, 45, 67, 96, 160, 251, 512, 765, 1024, 1531, 2048, 3072, 4093, 6144, 8192,
               12288, 16384, 24576, 32768)
SHORT_PROMPT_TOKENS = 256  # at or below: cheap, noisier in relative terms -> more repeats
LONG_PROMPT_TOKENS = 2048  # above: expensive -> fewer repeats
CONTENDED_SLACK_S = 0.05  # CPU-seconds of other processes tolerated during one timed call
CONTENTION_WARNING = 0.05  # other processes' share of the CPU above which a profile says so
IDENTITY_KEYS = ("device", "device_name", "model_id", "weights_hash", "dtype", "threads",
                 "context_window", "backend")


@runtime_checkable
class PrefillTimer(Protocol):
    """What calibration needs from a generator.

    ``identity``: dict with :data:`IDENTITY_KEYS`.
    ``prefill_ms(prompt_tokens, cached_tokens)``: wall ms of one prefill of
    ``prompt_tokens`` tokens whose first ``cached_tokens`` come from a prefix KV
    cache (building that cache is not timed), up to the first token's logits,
    synchronised on CUDA.
    ``decode_step_ms(context_tokens)``: wall ms of one decode step at that context.
    """

    identity: dict[str, Any]

    def prefill_ms(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Wall ms of one prefill of ``prompt_tokens`` tokens, the first ``cached_tokens`` from
        a prefix KV cache (building it not timed), up to the first token's logits."""
        ...

    def decode_step_ms(self, context_tokens: int) -> float:
        """Wall ms of one decode step (one new token) with ``context_tokens`` tokens in the KV cache."""
        ...


@runtime_checkable
class StepTimer(Protocol):
    """What mixed-step calibration needs from a generator that batches answers.

    ``max_running``: decode answers one step may carry at most.
    ``step_ms(prefill_tokens, prefill_pos, decode_contexts, prefill_needs_logits)``: wall ms of
    one engine step carrying a prefill chunk (0 tokens: none) and one decode token per context.
    """

    max_running: int

    def step_ms(self, prefill_tokens: int, prefill_pos: int, decode_contexts: list[int],
                prefill_needs_logits: bool = True) -> float:
        """Wall ms of one engine step of that shape."""
        ...


@dataclass(frozen=True)
class CalibrationGrid:
    """What to measure. Token counts in tokens.

    A fit point ``(n, c)`` is measured ``short_repeats`` times when
    ``n <= SHORT_PROMPT_TOKENS``, ``long_repeats`` times when ``n > LONG_PROMPT_TOKENS``,
    else ``repeats`` times (:meth:`repeats_for`).
    """

    name: str
    prompt_tokens: tuple[int, ...]
    cached_tokens: tuple[int, ...]
    repeats: int
    warmup: int
    fresh_points: int
    decode_contexts: tuple[int, ...]
    decode_repeats: int
    max_prompt_tokens: int
    note: str
    short_repeats: int = 5
    long_repeats: int = 2
    # mixed-step calibration (latency_model.step_model): random step shapes, fitted and fresh
    step_points: int = 0
    step_repeats: int = 2
    step_fresh_points: int = 0

    def repeats_for(self, prompt_tokens: int) -> int:
        """How many times the fit points of this prompt length are measured."""
        if prompt_tokens <= SHORT_PROMPT_TOKENS:
            return self.short_repeats
        if prompt_tokens > LONG_PROMPT_TOKENS:
            return self.long_repeats
        return self.repeats

    def fit_points(self) -> list[tuple[int, int]]:
        """``(prompt, cached)`` pairs measured for fitting: every length x every cached length < it."""
        return [(n, c) for n in self.prompt_tokens for c in self.cached_tokens if c < n]


def _cached_list(scaffold_tokens: list[int], top: int) -> tuple[int, ...]:
    if any(int(s) < 0 for s in scaffold_tokens):
        raise InvalidInput("scaffold token counts must be >= 0")
    return tuple(sorted({0, *(int(s) for s in scaffold_tokens if 0 < int(s) < top)}))


def chunk_lengths(chunk_tokens: int | None, top: int) -> set[int]:
    """Prompt lengths just past a chunk boundary (``S + 45`` and ``4*S + 77`` tokens, below
    ``top``), added to a grid when the engine prefills in chunks of ``S``: there a cached
    scaffold saves a whole forward pass (``latency_model.predictors.forward_passes``), which
    identifies the per-pass cost that lengths on multiples of ``S`` cannot."""
    if not chunk_tokens or chunk_tokens < 1:
        return set()
    return {n for n in (chunk_tokens + 45, 4 * chunk_tokens + 77) if n < top}


def engine_chunk_tokens(identity: dict[str, Any]) -> int | None:
    """The prefill chunk size a generator's identity records (``engine.prefill_chunk``), or None."""
    engine = identity.get("engine")
    chunk = engine.get("prefill_chunk") if isinstance(engine, dict) else None
    return int(chunk) if isinstance(chunk, int) and chunk >= 1 else None


def quick_grid(context_window: int, scaffold_tokens: list[int],
               chunk_tokens: int | None = None) -> CalibrationGrid:
    """The ``--quick`` grid: prompts up to 2048 tokens (or the window less one).

    2048 tokens is where the planner operates on a CPU with a sub-10 s budget; a
    profile from this grid says so in ``calibration.note`` and predictions past
    it are extrapolations. Under 2 minutes for SmolLM2-135M on 2 CPU cores.
    ``chunk_tokens`` (the engine's prefill chunk) adds :func:`chunk_lengths`.

    Raises:
        InvalidInput: ``context_window < 16`` or a negative scaffold size.
    """
    if context_window < 16:
        raise InvalidInput("context_window must be >= 16 tokens")
    top = min(context_window - 1, QUICK_MAX_PROMPT_TOKENS)
    ladder = tuple(sorted({n for n in QUICK_LADDER if n < top} | {top} | chunk_lengths(chunk_tokens, top)))
    return CalibrationGrid(
        name="quick", prompt_tokens=ladder, cached_tokens=_cached_list(scaffold_tokens, top),
        repeats=3, warmup=3, fresh_points=16, step_points=32, step_repeats=2, step_fresh_points=32,
        decode_contexts=_decode_contexts((16, 512, 1024), context_window, top),
        decode_repeats=4, max_prompt_tokens=top,
        note=f"quick grid: prompts {ladder[0]}..{top} tokens of a {context_window}-token window; "
             f"predictions above {top} tokens are extrapolated")


def _decode_contexts(ladder: tuple[int, ...], context_window: int, top: int) -> tuple[int, ...]:
    """Decode contexts to time: ``ladder`` below ``top`` plus the largest one a decode step can
    have. A decode step after ``c`` tokens writes position ``c`` and yields a second token, so
    ``c <= context_window - 2`` (at ``context_window - 1`` the answer ends at its first token
    and there is no step to time)."""
    last = min(top, context_window - 2)
    return tuple(sorted({c for c in ladder if c < last} | {last}))


def full_grid(context_window: int, scaffold_tokens: list[int],
              chunk_tokens: int | None = None) -> CalibrationGrid:
    """The full grid: prompts from 8 tokens up to the whole context window (less one token);
    ``chunk_tokens`` as in :func:`quick_grid`.

    Raises:
        InvalidInput: ``context_window < 16`` or a negative scaffold size.
    """
    if context_window < 16:
        raise InvalidInput("context_window must be >= 16 tokens")
    top = context_window - 1  # one position stays free for the first generated token
    ladder = tuple(sorted({n for n in FULL_LADDER if n < top} | {top} | chunk_lengths(chunk_tokens, top)))
    return CalibrationGrid(
        name="full", prompt_tokens=ladder, cached_tokens=_cached_list(scaffold_tokens, top),
        repeats=3, warmup=3, fresh_points=24, step_points=64, step_repeats=3, step_fresh_points=48,
        decode_contexts=_decode_contexts((16, 512, 2048, 4096), context_window, top),
        decode_repeats=4, max_prompt_tokens=top,
        note=f"full grid: prompts {ladder[0]}..{top} tokens (the whole {context_window}-token window)")


def _fresh_points(grid: CalibrationGrid, rng: random.Random) -> list[tuple[int, int]]:
    lo, hi = math.log(max(4, grid.prompt_tokens[0])), math.log(grid.max_prompt_tokens)
    taken = set(grid.prompt_tokens)
    out: list[tuple[int, int]] = []
    while len(out) < grid.fresh_points:
        n = int(round(math.exp(rng.uniform(lo, hi))))
        if n in taken or n > grid.max_prompt_tokens:
            continue
        cached = [c for c in grid.cached_tokens if c < n]
        out.append((n, rng.choice(cached)))
        taken.add(n)
    return out


def schedule(grid: CalibrationGrid, seed: int) -> list[tuple[str, int, int, str]]:
    """The measurement order: ``(kind, tokens, cached, role)`` with kind ``prefill``/``decode``.

    Warm-ups first (``warmup`` calls per cached length, alternating the smallest
    and a middle length), then fit
    points x their repeats, fresh points and decode steps, all shuffled together with
    ``random.Random(seed)``. Deterministic for a given grid and seed.
    """
    rng = random.Random(seed)
    mid = grid.prompt_tokens[len(grid.prompt_tokens) // 2]
    warm = [("prefill", max((grid.prompt_tokens[0], mid)[i % 2], c + 1), c, "warmup")
            for c in grid.cached_tokens for i in range(grid.warmup)]
    warm += [("decode", grid.decode_contexts[0], 0, "warmup")]
    body = [("prefill", n, c, "fit") for n, c in grid.fit_points() for _ in range(grid.repeats_for(n))]
    body += [("prefill", n, c, "fresh") for n, c in _fresh_points(grid, rng)]
    body += [("decode", ctx, 0, "fit") for ctx in grid.decode_contexts for _ in range(grid.decode_repeats)]
    rng.shuffle(body)
    return warm + body


StepPoint = tuple[int, int, tuple[int, ...], bool]  # (prefill tokens, position, decode contexts, logits)


def step_design(grid: CalibrationGrid, seed: int, max_decode: int,
                chunk_tokens: int | None = None) -> list[tuple[StepPoint, str]]:
    """Random mixed-step shapes to time: ``[(point, role)]``, role ``fit`` (each point
    ``step_repeats`` times) or ``fresh``, unshuffled; deterministic for a seed.

    A point has 0 to ``max_decode`` decode answers (contexts log-uniform in 16 .. the top
    prompt length) and, unless it has decoders and draws none, one prefill chunk of 1 ..
    ``chunk_tokens`` (default 256) tokens, a full chunk a third of the time, at position 0 a
    third of the time and else anywhere it fits; a fifth of the chunks need no logits.
    """
    rng = random.Random(seed * 7919 + 17)
    chunk = chunk_tokens or 256
    top = grid.max_prompt_tokens

    def draw() -> StepPoint:
        d = rng.choice([n for n in (0, 1, 2, 3, 4, 6, 8) if n <= max_decode])
        ctx = tuple(int(round(math.exp(rng.uniform(math.log(16), math.log(top - 2))))) for _ in range(d))
        if d and rng.random() < 0.25:
            return 0, 0, ctx, True
        r = rng.random()
        n = chunk if r < 1 / 3 else rng.randint(1, max(1, chunk // 4)) if r < 2 / 3 else rng.randint(1, chunk)
        n = min(n, top - 2)
        pos = 0 if rng.random() < 1 / 3 else rng.randint(1, max(1, top - 2 - n))
        return n, pos, ctx, rng.random() >= 0.2

    out = [(p, "fit") for p in (draw() for _ in range(grid.step_points)) for _ in range(grid.step_repeats)]
    return out + [(draw(), "fresh") for _ in range(grid.step_fresh_points)]


def estimate_seconds(grid: CalibrationGrid, profile: Profile, seed: int = 0) -> float:
    """Predicted wall time of calibrating ``grid``, from a profile of the same generator, in s.

    Sums the p50 of every scheduled prefill and decode call, plus, for each
    decode call, one prefill of its context (a timer must build that KV cache;
    an upper bound for timers that keep it). Model loading is not included.
    """
    total_ms = 0.0
    for kind, tokens, cached, _role in schedule(grid, seed):
        if kind == "prefill":
            total_ms += profile.predict_ttft_ms(tokens, cached)[0]
        else:
            total_ms += profile.predict_tpot_ms(tokens) + profile.predict_ttft_ms(tokens, 0)[0]
    return total_ms / 1e3


def _measure(value: float, what: str) -> float:
    ms = float(value)
    if not math.isfinite(ms) or ms <= 0:
        raise BackendError(f"timer returned {value!r} ms for {what}; expected a positive time")
    return ms


def contended(others_cpu_s: float | None, wall_s: float, cores: int) -> bool:
    """True when other processes used more than 50 ms + 10 % of all cores during a timed call.

    On a machine whose cores the timed threads fill, any such use delays a
    thread that the others then wait for (2 torch threads on 2 cores: 5-20x
    slower prefills were observed). The 50 ms slack absorbs ``/proc/stat``'s
    10 ms ticks and idle daemons.
    """
    return others_cpu_s is not None and others_cpu_s > CONTENDED_SLACK_S + 0.1 * wall_s * cores


def calibrate(timer: PrefillTimer, *, grid: CalibrationGrid, seed: int = 0, progress: bool = True,
              prefill_model: str | None = None, contention_retries: int = 2,
              cpu_probe: Callable[[], tuple[float, float, float] | None] | None = None) -> Profile:
    """Measure ``timer`` over ``grid`` and fit a ``source="fitted"`` :class:`Profile`.

    Each call is bracketed by :func:`latency_model.probe.cpu_snapshot`; a call
    during which other processes used the CPU (:func:`contended`) is kept with
    role ``contended:<role>`` (never fitted or scored) and measured again, up
    to ``contention_retries`` times per call and a quarter of the schedule in
    all; what is measured last is kept with its role either way. For a remote engine
    (``identity["device"] == "remote"``) nothing is judged contended: the engine may run
    on this machine in another process, whose CPU time would count as "other", so
    every call would look contended; the profile says so in a note instead.

    Args:
        timer: the generator (see :class:`PrefillTimer`).
        grid: :func:`quick_grid` or :func:`full_grid` output.
        seed: seeds the interleaved order and the fresh points.
        progress: show a tqdm bar on stderr.
        prefill_model: force a prefill form; default: chosen by leave-one-length-out MAPE
            (:func:`latency_model.fitting.select_prefill`).
        contention_retries: re-measurements of a contended call (0: keep every first measurement).
        cpu_probe: where CPU snapshots come from (default
            :func:`latency_model.probe.cpu_snapshot`, this machine's ``/proc/stat``). A timer
            that does no real work (a test double) passes ``lambda: None``, so nothing is judged
            contended and the profile does not depend on what else this machine runs.

    Raises:
        BackendError: the timer failed or returned a non-positive time.
        InvalidInput: the grid has fewer than three prompt lengths.
    """
    import os

    from tqdm import tqdm

    from latency_model import probe
    from latency_model.probe import other_cpu_fraction, other_cpu_seconds

    cpu_snapshot = cpu_probe if cpu_probe is not None else probe.cpu_snapshot

    identity = dict(timer.identity)
    remote = str(identity.get("device") or "") == "remote"
    if remote:
        contention_retries = 0
    plan: list[tuple[str, Any, int, str]] = list(schedule(grid, seed))
    steps: list[StepPoint] = []
    if isinstance(timer, StepTimer) and grid.step_points:
        design = step_design(grid, seed, int(timer.max_running), engine_chunk_tokens(identity))
        steps = [p for p, _ in design]
        srng = random.Random(seed + 1)
        first = sum(1 for item in plan if item[3] == "warmup")
        plan = plan[:first] + [("step", i, 0, "warmup") for i in range(min(2, len(steps)))] + plan[first:]
        for i, (_, role) in enumerate(design):
            plan.insert(srng.randint(first + 2, len(plan)), ("step", i, 0, role))
    step_rows: list[list[Any]] = []
    cores = os.cpu_count() or 1
    retry_budget = len(plan) // 4
    prefill_rows: list[list[Any]] = []
    decode_rows: list[list[Any]] = []
    started = utc_now_iso()
    cpu_start = cpu_snapshot()
    bar = tqdm(total=len(plan), desc=f"calibrate ({grid.name})", unit="call", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    try:
        for kind, tokens, cached, role in plan:
            bar.set_postfix_str(f"{kind} {tokens}/{cached}", refresh=False)
            for attempt in range(contention_retries + 1):
                before = cpu_snapshot()
                if kind == "prefill":
                    ms = _measure(timer.prefill_ms(tokens, cached), f"prefill({tokens}, {cached})")
                elif kind == "step":
                    n, pos, ctx, logits = steps[tokens]
                    ms = _measure(cast(StepTimer, timer).step_ms(n, pos, list(ctx), logits),
                                  f"step({n}@{pos}, {len(ctx)} decoding)")
                else:
                    ms = _measure(timer.decode_step_ms(tokens), f"decode_step({tokens})")
                after = cpu_snapshot()
                busy = (role != "warmup" and attempt < contention_retries and retry_budget > 0
                        and before is not None and after is not None
                        and contended(other_cpu_seconds(before, after), after[2] - before[2], cores))
                tag = f"contended:{role}" if busy else role
                if kind == "prefill":
                    prefill_rows.append([tokens, cached, ms, tag])
                elif kind == "step":
                    n, pos, ctx, logits = steps[tokens]
                    step_rows.append([n, pos, list(ctx), bool(logits), tokens, ms, tag])
                else:
                    decode_rows.append([tokens, ms, tag])
                if not busy:
                    break
                retry_budget -= 1
            bar.update(1)
    finally:
        bar.close()
    contention = None if remote else other_cpu_fraction(cpu_start, cpu_snapshot())
    return fit_profile(identity, prefill_rows, decode_rows, grid=grid, seed=seed, started_at=started,
                       prefill_model=prefill_model, other_cpu_fraction=contention, step_rows=step_rows)


def fit_profile(identity: dict[str, Any], prefill_rows: list[list[Any]], decode_rows: list[list[Any]],
                *, grid: CalibrationGrid, seed: int, started_at: str,
                prefill_model: str | None = None, other_cpu_fraction: float | None = None,
                step_rows: list[list[Any]] | None = None) -> Profile:
    """Fit a profile from raw rows ``[prompt, cached, ms, role]`` and ``[context, ms, role]``,
    and, when given, mixed-step rows ``[prefill tokens, position, [decode contexts], needs logits,
    point id, ms, role]`` (fitted into ``Profile.step_model`` by
    :func:`latency_model.step_model.fit_steps`).

    Fit rows (role ``fit``) train the models; ``fresh`` rows score them (MAPE of
    the p50, share of measurements at or below the p95); ``warmup`` and
    ``contended:*`` rows are kept but unused. ``other_cpu_fraction`` (share of the
    CPU other processes used during the run) is recorded, with a note when it is
    high enough to inflate timings.

    Raises:
        InvalidInput: too few fit rows or lengths.
    """
    # Columns: prompt tokens, cached tokens, ms (prefill); context tokens, ms (decode).
    fit = np.array([r[:3] for r in prefill_rows if r[3] == "fit"],
                   dtype=np.float64).reshape(-1, 3)  # (N_fit, 3)
    fresh = np.array([r[:3] for r in prefill_rows if r[3] == "fresh"],
                     dtype=np.float64).reshape(-1, 3)  # (N_fresh, 3)
    dec = np.array([r[:2] for r in decode_rows if r[2] == "fit"],
                   dtype=np.float64).reshape(-1, 2)  # (N_dec, 2)
    chunk = engine_chunk_tokens(identity)
    if prefill_model is None:
        chosen, comparison = select_prefill(fit[:, 0], fit[:, 1], fit[:, 2], chunk_tokens=chunk)
    else:
        chosen = fit_prefill(fit[:, 0], fit[:, 1], fit[:, 2], prefill_model, chunk)
        comparison = {prefill_model: chosen.loo_length_mape}
    decode_fit = fit_decode(dec[:, 0], dec[:, 1])
    step_model = _fit_step_rows(step_rows or [])
    device = str(identity.get("device", "cpu"))
    profile_kwargs: dict[str, Any] = dict(
        source="fitted", created_at=utc_now_iso(), device=device,
        device_name=str(identity.get("device_name", device)),
        model_id=str(identity.get("model_id", "unknown")),
        # a remote engine reports no weights hash or dtype (None): "" as the profile key has it
        weights_hash=str(identity.get("weights_hash") or ""),
        dtype=str(identity.get("dtype") or "").replace("torch.", ""),
        threads=identity.get("threads") if device.startswith("cpu") else None,
        backend=str(identity.get("backend", "local")),
        context_window=identity.get("context_window"),
        prefill_model=chosen.predictor.name, prefill_coefficients=chosen.predictor.coefficients,
        prefill_chunk_tokens=chosen.predictor.chunk_tokens, step_model=step_model,
        prefill_quantiles=chosen.quantiles, prefill_abs_quantiles_ms=chosen.abs_quantiles_ms,
        decode_model=decode_fit.predictor.name, decode_coefficients=decode_fit.predictor.coefficients,
        decode_quantiles=decode_fit.quantiles,
        form_comparison={k: finite_or_none(v) for k, v in comparison.items()},
        calibration={**asdict(grid), "seed": seed, "started_at": started_at,
                     "prefill_fit_samples": int(fit.shape[0]), "fresh_samples": int(fresh.shape[0]),
                     "decode_samples": int(dec.shape[0]),
                     "contended_samples": sum(1 for r in prefill_rows + decode_rows
                                              if str(r[-1]).startswith("contended:")),
                     "other_cpu_fraction": finite_or_none(other_cpu_fraction)},
        samples={"prefill": [[int(n), int(c), float(ms), str(role)] for n, c, ms, role in prefill_rows],
                 "decode": [[int(x), float(ms), str(role)] for x, ms, role in decode_rows],
                 **({"step": [[int(r[0]), int(r[1]), [int(x) for x in r[2]], bool(r[3]), int(r[4]),
                               float(r[5]), str(r[6])] for r in step_rows]} if step_rows else {})},
        software=software_versions(), notes=[grid.note] + (
            [f"other processes used {other_cpu_fraction:.0%} of the CPU during calibration; "
             f"timings may be inflated, re-run on a quiet machine"]
            if other_cpu_fraction is not None and other_cpu_fraction > CONTENTION_WARNING else []) + (
            ["remote engine: timed from the client side, network included; other processes' CPU use "
             "is not judged (the engine's own process may run on this machine)"]
            if str(identity.get("device") or "") == "remote" else []),
    )
    held_out: dict[str, Any] = {
        "loo_length_mape": finite_or_none(chosen.loo_length_mape),
        "in_sample_mape": finite_or_none(chosen.in_sample_mape),
        "decode_loo_context_mape": finite_or_none(decode_fit.loo_context_mape),
        "decode_in_sample_mape": finite_or_none(decode_fit.in_sample_mape),
        "fresh_points": int(fresh.shape[0]), "fresh_mape": None, "fresh_p95_coverage": None,
    }
    draft = Profile.create(held_out=held_out, **profile_kwargs)
    if fresh.shape[0]:
        p50, p95 = draft.predict_ttft_many(fresh[:, 0], fresh[:, 1])  # (N_fresh,) ms each
        held_out["fresh_mape"] = finite_or_none(mape(fresh[:, 2], p50))
        held_out["fresh_p95_coverage"] = finite_or_none(coverage(fresh[:, 2], p95))
        return Profile.create(held_out=held_out, **profile_kwargs)
    return draft


def _fit_step_rows(rows: list[list[Any]]) -> dict[str, Any]:
    """``StepFit.to_dict()`` of the ``fit`` step rows scored on the ``fresh`` ones; {} when there
    are fewer than three fitted design points."""
    from latency_model.step_model import StepShape, fit_steps

    def shape(r: list[Any]) -> StepShape:
        return StepShape.mixed(int(r[0]), int(r[1]), [int(x) for x in r[2]], bool(r[3]))

    fit_rows = [r for r in rows if r[6] == "fit"]
    fresh_rows = [r for r in rows if r[6] == "fresh"]
    if len({int(r[4]) for r in fit_rows}) < 3:
        return {}
    fit = fit_steps([shape(r) for r in fit_rows], [float(r[5]) for r in fit_rows],
                    [int(r[4]) for r in fit_rows], [shape(r) for r in fresh_rows],
                    [float(r[5]) for r in fresh_rows])
    return {k: finite_or_none(v) if isinstance(v, float) else v for k, v in fit.to_dict().items()}


def make_prior(identity: dict[str, Any], config: dict[str, Any]) -> Profile:
    """A roofline prior for ``identity``: datasheet peaks on a GPU, a < 1 s probe on a CPU.

    Raises:
        InvalidConfig: a GPU not in the datasheet table, or a config without the needed fields.
    """
    from latency_model.probe import probe_cpu

    device = str(identity.get("device", "cpu"))
    dtype = str(identity.get("dtype", "float32"))
    if device.startswith("cuda"):
        flops, bw, source = datasheet_peaks(str(identity.get("device_name", "")), dtype)
    else:
        probe = probe_cpu(int(identity.get("threads") or 1))
        flops, bw, source = probe["peak_flops"], probe["bandwidth_bytes_s"], probe["source"]
    return build_prior(identity, config, peak_flops=flops, bandwidth_bytes_s=bw, peaks_source=source,
                       created_at=utc_now_iso(), software=software_versions())
