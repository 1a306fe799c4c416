"""Calibration design: what to measure, in what order, and how long it will take.

A grid (:class:`CalibrationGrid`) crosses prompt lengths with cached-prefix
lengths, repeats each point (more for short, cheap prompts, fewer for long ones),
adds fresh points at random lengths that are measured but never fitted, and
mixed-step shapes for the step model (:func:`step_design`). :func:`schedule`
puts warm-ups first and shuffles the rest with a seeded RNG, so slow drifts
(thermal, other processes) spread over all points instead of biasing one length.
Nothing here reads a clock: :mod:`latency_model.calibration` runs the schedule
and fits the profile.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from foundation.errors import InvalidInput
from latency_model.profile import Profile

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
