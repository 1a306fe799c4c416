"""The mixed-step cost model: one engine step's time from what the step carries.

The continuous-batching engine (``generation.engine``) runs one forward per
step over a packed row of tokens: one decode token per running answer plus
prefill chunks, padded to ``R`` rows (``generation.engine.scheduler.padded_rows``:
at least 16, multiples of 8, on CPU). A step that carries ``S`` segments (answers), segment ``i`` with
``n_i`` new tokens at positions ``[p_i, p_i + n_i)``, costs

    step_ms = a + b*R + s*S + g*A + e*K + h*H            (all coefficients >= 0)

* ``a``: fixed cost of a forward (dispatch of every layer's kernels);
* ``b*R``: the linear layers over the padded rows (``2*P`` FLOP per row);
* ``s*S``: per-segment work in the attention function (a KV write, a slice, an
  SDPA call per layer and answer: Python and kernel set-up, not FLOPs);
* ``g*A``, ``A = sum n_i*(p_i + n_i)``: attention scores; the engine gives each
  segment an explicit mask, so the whole ``n_i x (p_i + n_i)`` rectangle is
  computed (decode: ``n_i = 1``);
* ``e*K``, ``K = sum (p_i + n_i)``: keys and values read, once per segment and
  layer (what makes a decode step grow with its context);
* ``h*H``: the LM head on ``H`` padded logit rows (0 on a step that only
  prefills a chunk that does not end a prompt).

This is the Vidur / Sarathi-Serve view of a step as a sum of operator costs
(Agrawal et al., MLSys 2024; OSDI 2024), with the operators lumped into the terms
this engine's shapes drive. It is fitted by relative-error NNLS
(:func:`latency_model.predictors.weighted_nnls`), scored on held-out design
points (leave-one-point-out over all repeats of a point) and on fresh points
never fitted, and stored in the profile (``Profile.step_model``).

:func:`predict_batched_ttft_ms` uses it to predict a new answer's TTFT given the
running batch: the answer's prefill chunks ride along with the running answers'
decode tokens, step by step: :func:`batched_step_shapes` replays the engine's own scheduler
(:func:`generation.engine.scheduler.schedule`) over the batch the engine shows
(:class:`generation.engine.messages.BatchSnapshot`), so the steps priced are the steps the
engine plans; the row padding is the scheduler's too (one definition).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from foundation.errors import InvalidInput
from generation.engine.messages import Decoding, Prefilling, StepRecord
from generation.engine.scheduler import MIN_ROWS, ROW_MULTIPLE, StepPlan, padded_rows, schedule
from latency_model.fitting import coverage, leave_one_group_out, mape, relative_residuals, residual_quantiles
from latency_model.predictors import weighted_nnls

STEP_FORM = "mixed_step"
STEP_COEFFICIENTS = ("a", "b", "s", "g", "e", "h")
STEP_FORMULA = "a + b*R + s*S + g*A + e*K + h*H"
# The engine's row padding on CPU (the scheduler's); a profile records the padding it was fitted with.
DEFAULT_MIN_ROWS = MIN_ROWS
DEFAULT_ROW_MULTIPLE = ROW_MULTIPLE


@dataclass(frozen=True)
class StepShape:
    """What one step carries: ``segments`` as ``(new tokens, start position)`` pairs, one per
    answer (a decode token is ``(1, context)``), and how many of them need logits."""

    segments: tuple[tuple[int, int], ...]
    logit_rows: int

    @classmethod
    def mixed(cls, prefill_tokens: int, prefill_pos: int, decode_contexts: Sequence[int],
              prefill_needs_logits: bool = True) -> StepShape:
        """A step with one prefill chunk of ``prefill_tokens`` at ``prefill_pos`` (0 tokens: none)
        and one decode token per context in ``decode_contexts``.

        Raises:
            InvalidInput: negative counts, or a step with nothing in it.
        """
        if prefill_tokens < 0 or prefill_pos < 0 or any(int(x) < 0 for x in decode_contexts):
            raise InvalidInput("step token counts must be >= 0")
        segs = [(1, int(x)) for x in decode_contexts]
        if prefill_tokens:
            segs.append((int(prefill_tokens), int(prefill_pos)))
        if not segs:
            raise InvalidInput("a step carries at least one token")
        return cls(tuple(segs), len(decode_contexts) + int(bool(prefill_tokens) and prefill_needs_logits))

    @classmethod
    def of_plan(cls, plan: StepPlan) -> StepShape:
        """The shape of a step the engine's scheduler planned (its segments and logit rows)."""
        return cls(plan.segments, plan.logit_rows)


def padded(n: int, min_rows: int = DEFAULT_MIN_ROWS, multiple: int = DEFAULT_ROW_MULTIPLE) -> int:
    """Rows a step of ``n`` real rows runs with on CPU (the engine's own rule,
    :func:`generation.engine.scheduler.padded_rows`); 0 -> 0 (an LM head that does not run)."""
    if n <= 0:
        return 0
    return padded_rows(n, None, min_rows, multiple)


def step_features(shapes: Sequence[StepShape], min_rows: int = DEFAULT_MIN_ROWS,
                  multiple: int = DEFAULT_ROW_MULTIPLE) -> NDArray[np.float64]:
    """``(N, 6)`` features ``[1, R, S, A, K, H]`` of ``N`` steps (see the module docstring)."""
    rows = []
    for sh in shapes:
        tokens = sum(n for n, _ in sh.segments)
        rows.append([1.0, padded(tokens, min_rows, multiple), len(sh.segments),
                     sum(n * (p + n) for n, p in sh.segments), sum(p + n for n, p in sh.segments),
                     padded(sh.logit_rows, min_rows, multiple)])
    return np.asarray(rows, dtype=np.float64).reshape(-1, 6)  # (N, 6)


@dataclass(frozen=True)
class StepFit:
    """A fitted mixed-step model: coefficients (ms per feature unit), quantiles of the
    held-out (leave-one-point-out) relative residuals and held-out errors (fractions).
    ``to_dict``/``from_dict`` are what a profile stores."""

    coefficients: dict[str, float]
    quantiles: dict[str, float]
    in_sample_mape: float
    loo_point_mape: float
    fresh_mape: float | None = None
    fresh_p95_coverage: float | None = None
    fresh_points: int = 0
    min_rows: int = DEFAULT_MIN_ROWS
    row_multiple: int = DEFAULT_ROW_MULTIPLE
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def beta(self) -> NDArray[np.float64]:
        """``(6,)`` coefficients in :data:`STEP_COEFFICIENTS` order."""
        return np.array([self.coefficients[k] for k in STEP_COEFFICIENTS], dtype=np.float64)

    def predict_point_ms(self, shapes: Sequence[StepShape]) -> NDArray[np.float64]:
        """Point predictions (ms), ``(N,)``."""
        return np.asarray(step_features(shapes, self.min_rows, self.row_multiple) @ self.beta,
                          dtype=np.float64)

    def predict_ms(self, shapes: Sequence[StepShape]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """``((N,) p50 ms, (N,) p95 ms)``: point x (1 + q50), point x (1 + q95)."""
        point = self.predict_point_ms(shapes)
        p50 = point * (1.0 + self.quantiles.get("p50", 0.0))
        return p50, np.maximum(point * (1.0 + self.quantiles.get("p95", 0.0)), p50)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: form, formula, coefficients, quantiles, errors, padding rule."""
        return {"form": STEP_FORM, "formula": STEP_FORMULA, "coefficients": dict(self.coefficients),
                "quantiles": dict(self.quantiles), "in_sample_mape": self.in_sample_mape,
                "loo_point_mape": self.loo_point_mape, "fresh_mape": self.fresh_mape,
                "fresh_p95_coverage": self.fresh_p95_coverage, "fresh_points": self.fresh_points,
                "min_rows": self.min_rows, "row_multiple": self.row_multiple, "extra": dict(self.extra)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepFit:
        """Rebuild from :meth:`to_dict` output.

        Raises:
            InvalidInput: another form, or missing or negative coefficients.
        """
        if data.get("form") != STEP_FORM:
            raise InvalidInput(f"unknown step model form {data.get('form')!r}")
        coef = data.get("coefficients") or {}
        if set(coef) != set(STEP_COEFFICIENTS) or any(not math.isfinite(v) or v < 0 for v in coef.values()):
            raise InvalidInput(f"step model needs non-negative coefficients {STEP_COEFFICIENTS}")
        return cls(coefficients={k: float(coef[k]) for k in STEP_COEFFICIENTS},
                   quantiles={k: float(v) for k, v in (data.get("quantiles") or {}).items()},
                   in_sample_mape=float(data["in_sample_mape"]), loo_point_mape=float(data["loo_point_mape"]),
                   fresh_mape=data.get("fresh_mape"), fresh_p95_coverage=data.get("fresh_p95_coverage"),
                   fresh_points=int(data.get("fresh_points") or 0),
                   min_rows=int(data.get("min_rows") or DEFAULT_MIN_ROWS),
                   row_multiple=int(data.get("row_multiple") or DEFAULT_ROW_MULTIPLE),
                   extra=dict(data.get("extra") or {}))


def fit_steps(shapes: Sequence[StepShape], step_ms: ArrayLike, point_ids: ArrayLike,
              fresh_shapes: Sequence[StepShape] = (), fresh_ms: ArrayLike = (),
              min_rows: int = DEFAULT_MIN_ROWS, multiple: int = DEFAULT_ROW_MULTIPLE) -> StepFit:
    """Fit the mixed-step model to timed steps and score it.

    Args:
        shapes: ``N`` timed steps (repeats are separate rows).
        step_ms: ``(N,)`` measured step times, ms, > 0.
        point_ids: ``(N,)`` design-point id of each row (repeats share one); the held-out
            error leaves each point out with all its repeats.
        fresh_shapes, fresh_ms: steps measured in the same run but never fitted: MAPE of the
            p50 and the share at or below the p95.

    Raises:
        InvalidInput: fewer than three design points, or bad measurements.
    """
    x = step_features(shapes, min_rows, multiple)  # (N, 6)
    y = np.asarray(step_ms, dtype=np.float64)  # (N,)
    groups = np.asarray(point_ids, dtype=np.float64)  # (N,)
    beta = weighted_nnls(x, y)  # (6,)
    fitted = x @ beta  # (N,)

    def _fp(train: NDArray[np.bool_], test: NDArray[np.bool_]) -> NDArray[np.float64]:
        return np.asarray(x[test] @ weighted_nnls(x[train], y[train]), dtype=np.float64)

    held = np.maximum(leave_one_group_out(_fp, groups, y.size), 1e-9)  # (N,)
    # The band is read off held-out residuals (each point predicted by a fit that never saw
    # it: the jackknife+ of Barber et al., Ann. Statist. 2021), not in-sample ones: six
    # coefficients fitted on 32-64 points shrink in-sample residuals, and a new step's error
    # is a held-out one. On the main job's quick calibration (2026-12-01) the fresh p95
    # coverage was 15/16 in-sample and 16/16 held-out (docs/latency_model.md).
    fit = StepFit(coefficients=dict(zip(STEP_COEFFICIENTS, beta.tolist(), strict=True)),
                  quantiles=residual_quantiles(relative_residuals(y, held)),
                  in_sample_mape=mape(y, fitted), loo_point_mape=mape(y, held),
                  min_rows=min_rows, row_multiple=multiple)
    fy = np.asarray(fresh_ms, dtype=np.float64)
    if len(fresh_shapes) and fy.size == len(fresh_shapes):
        p50, p95 = fit.predict_ms(fresh_shapes)
        fit = replace(fit, fresh_mape=mape(fy, p50), fresh_p95_coverage=coverage(fy, p95),
                      fresh_points=int(fy.size))
    return fit


#: Steps :func:`machine_speed` needs before it reads a speed (a median of fewer is noise).
MIN_SPEED_STEPS = 8


def machine_speed(fit: StepFit, steps: Sequence[StepRecord]) -> tuple[float, int] | None:
    """How fast the machine runs engine steps now against the step model: ``(speed, steps)``.

    ``steps``: timed steps, the engine's step log
    (:class:`generation.engine.messages.StepRecord`: segments as in :class:`StepShape`,
    logit rows, ms). ``speed`` is the median over them of measured / predicted point
    time, each step weighted by its predicted time (1.0: as at calibration; 1.4: steps take
    40 % longer), ``steps`` how many were read. Every decode step of every running answer
    is a measurement, so this follows a busier or quieter machine within seconds, where
    finished answers take tens of them. The median keeps one slow step (a page fault, a
    neighbour's burst) from moving it. The weights make it the robust form of total
    measured / total predicted time, what a plan scales: a machine need not slow every step
    alike. Beside a one-core CPU hog on a 2-core Xeon the plain median over an 8-token
    answer's steps (one per decode token, one per 256-token prefill chunk) read 1.83-2.07
    while prefills ran 2.21-2.30x the fitted p50; weighted, it read 2.06-2.20
    (docs/benchmarks.md, "The grid, sixteenth run").

    Returns ``None`` with fewer than :data:`MIN_SPEED_STEPS` usable steps (malformed or
    non-positive entries are skipped).
    """
    shapes: list[StepShape] = []
    measured: list[float] = []
    for step in steps:
        segs, logit_rows, ms = tuple((int(n), int(p)) for n, p in step.segments), step.logit_rows, step.ms
        if not segs or not math.isfinite(ms) or ms <= 0 or any(n < 1 or p < 0 for n, p in segs):
            continue
        shapes.append(StepShape(segs, int(logit_rows)))
        measured.append(float(ms))
    if len(shapes) < MIN_SPEED_STEPS:
        return None
    point = fit.predict_point_ms(shapes)  # (N,)
    ok = point > 0
    if int(ok.sum()) < MIN_SPEED_STEPS:
        return None
    ratios = np.asarray(measured, dtype=np.float64)[ok] / point[ok]  # (N',)
    # numpy's weighted quantile (weights need the inverted-CDF method): the smallest ratio whose
    # steps hold half the predicted time.
    speed = np.quantile(ratios, 0.5, weights=point[ok], method="inverted_cdf")
    return float(speed), int(ratios.size)


def prefill_schedule(prompt_tokens: int, cached_tokens: int, prefix_tokens: int,
                     chunk_tokens: int) -> list[tuple[int, int]]:
    """The chunks ``(tokens, start)`` the engine prefills a prompt in (``Sequence.next_chunk``):
    the uncached part of the scaffold ``[c, P)`` from ``c``, the rest ``[max(P, c), n)``.

    Raises:
        InvalidInput: not ``0 <= c <= n``, ``P <= n``, or ``chunk_tokens < 1``.
    """
    n, c, p, s = prompt_tokens, cached_tokens, prefix_tokens, chunk_tokens
    if not (0 <= c <= n and 0 <= p <= n and s >= 1):
        raise InvalidInput("bad prefill schedule arguments")
    out: list[tuple[int, int]] = []
    for lo, hi in ((c, max(p, c)), (max(p, c), n)):
        pos = lo
        while pos < hi:
            end = min(hi, pos + s)
            out.append((end - pos, pos))
            pos = end
    return out


@dataclass
class _Replayed:
    """One answer as the replay holds it: what the engine's scheduler reads of a request
    (:class:`generation.engine.scheduler.Schedulable`), plus the decode steps it has left
    (None: unbounded) and, for an answer ahead, whether it decodes once its prefill ends
    (``decodes_after``; False: it ends with its first token)."""

    pos: int
    prompt_len: int
    prefix_len: int
    chunk: int
    order: int | None
    decode_ready: bool = False
    steps_left: int | None = None
    decodes_after: bool = False


def batched_step_shapes(*, prompt_tokens: int, cached_tokens: int, prefix_tokens: int,
                        chunk_tokens: int, decode_contexts: Sequence[Decoding],
                        prefills_ahead: Sequence[Prefilling] = (),
                        step_token_budget: int | None = None) -> list[StepShape]:
    """The steps a new answer joining a running batch runs until its first token, in order
    (:func:`predict_batched_ttft_ms` prices them).

    Replays the engine's own scheduler (:func:`generation.engine.scheduler.schedule`) step by
    step over the batch: every running decoder's next token first, then one prefill chunk per
    answer still prefilling, in prefill order (the order answers were planned in), while the
    step's tokens stay within ``step_token_budget`` (the first chunk always fits; the first
    that does not fit ends the step's prefill, so no later answer overtakes); ``None``: one
    chunk a step (an unbounded chunk never shares). The answers still prefilling ahead of this
    one (``prefills_ahead``, in prefill order) come before it, its own chunks
    (:func:`prefill_schedule`) last; so the short tail of a long prompt ahead and a few short
    prompts share one step, as they do in the engine. Each running decoder
    (``decode_contexts``) grows by one a step and leaves the batch when its steps left run out
    (it reaches ``max_new_tokens``; one that stops at an end-of-text token leaves earlier, so
    this is an upper bound on what it costs; ``steps_left`` None: never leaves); an answer
    ahead joins the decoders when its prefill ends, for ``max_new - 1`` steps (its first token
    comes from the prefill; ``max_new`` None: for good). The steps end with the one that
    carries this answer's last chunk.

    Raises:
        InvalidInput: bad token counts.
    """
    prefill_schedule(prompt_tokens, cached_tokens, prefix_tokens, chunk_tokens)  # checks the counts
    # The batch in the engine's batch order: the decoders, the answers ahead (prefill order),
    # this answer; an answer ahead decodes in its own place once its prefill ends.
    batch = [_Replayed(int(d.context_tokens), int(d.context_tokens), 0, 1, None, True,
                       None if d.steps_left is None else int(d.steps_left))
             for d in decode_contexts]
    for order, e in enumerate(prefills_ahead):
        pos, end = int(e.position), int(e.position) + int(e.tokens_left)
        if pos < 0 or end < pos:
            raise InvalidInput("bad prefill ahead: negative position or tokens left")
        steps = None if e.max_new is None else int(e.max_new) - 1  # its first token: the prefill's
        # An answer ahead is chunked from its next position on (its scaffold boundary is not
        # in the snapshot), as the engine chunks a prompt past its scaffold.
        batch.append(_Replayed(pos, end, 0, chunk_tokens, order, steps_left=steps,
                               decodes_after=steps is None or steps >= 1))
    own = _Replayed(cached_tokens, prompt_tokens, prefix_tokens, chunk_tokens, len(prefills_ahead))
    batch.append(own)
    shapes: list[StepShape] = []
    while own.pos < own.prompt_len:
        plan = schedule(batch, step_token_budget)
        shapes.append(StepShape.of_plan(plan))
        for c in plan.chunks:
            req = batch[c.index]
            req.pos = c.start + c.tokens
            if c.decode:
                req.steps_left = None if req.steps_left is None else req.steps_left - 1
            elif req.pos == req.prompt_len and req is not own:  # its prefill ended: it decodes next
                req.decode_ready = req.decodes_after
        batch = [r for r in batch if r is own or r.pos < r.prompt_len
                 or (r.decode_ready and (r.steps_left is None or r.steps_left > 0))]
    return shapes


def predict_batched_ttft_ms(fit: StepFit, *, prompt_tokens: int, cached_tokens: int, prefix_tokens: int,
                            chunk_tokens: int, decode_contexts: Sequence[Decoding],
                            prefills_ahead: Sequence[Prefilling] = (),
                            step_token_budget: int | None = None) -> tuple[float, float]:
    """Predicted prefill time (model granted to first token) of a new answer joining a running
    batch, ``(p50 ms, p95 ms)``: the step model's p50s and p95s of the steps
    :func:`batched_step_shapes` says it runs (same arguments), added up (the p95 of a sum of
    positively correlated steps is at most the sum of their p95s).

    Raises:
        InvalidInput: bad token counts.
    """
    shapes = batched_step_shapes(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                                 prefix_tokens=prefix_tokens, chunk_tokens=chunk_tokens,
                                 decode_contexts=decode_contexts, prefills_ahead=prefills_ahead,
                                 step_token_budget=step_token_budget)
    if not shapes:
        return 0.0, 0.0
    p50, p95 = fit.predict_ms(shapes)
    return float(p50.sum()), float(p95.sum())


class BatchedBand:
    """A prefill band (``latency_model.planner.PrefillBand``) for an answer that will join a
    running batch: the wrapped band's prediction for the answer alone, plus what the batch
    adds by the step model.

    For each row, ``extra = step(batch) - step(alone)`` from :func:`predict_batched_ttft_ms`
    (p50 and p95 each, never below 0) is added to ``base``'s ``(p50, p95)``, so an empty
    batch plans exactly as before and the base keeps its calibration and online correction;
    the step model supplies only the difference the running answers make.

    Args:
        base: the profile (or corrected profile) the planner would use alone.
        fit: the profile's mixed-step model.
        chunk_tokens: the engine's prefill chunk size.
        decode_contexts: each running answer that is decoding (:func:`predict_batched_ttft_ms`).
        prefills_ahead: each answer still prefilling ahead of this one, in prefill order.
        step_token_budget: the engine's tokens per step (chunks of several answers share a
            step within it); ``None``: one chunk a step.
    """

    def __init__(self, base: Any, fit: StepFit, chunk_tokens: int,
                 decode_contexts: Sequence[Decoding], prefills_ahead: Sequence[Prefilling] = (),
                 step_token_budget: int | None = None) -> None:
        self.base, self.fit, self.chunk_tokens = base, fit, int(chunk_tokens)
        self.decode_contexts = list(decode_contexts)
        self.prefills_ahead = list(prefills_ahead)
        self.step_token_budget = None if step_token_budget is None else int(step_token_budget)
        self.id: str = base.id
        self.source: str = base.source

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def batch_extra_ms(self, prompt_tokens: int, cached_tokens: int,
                       prefix_tokens: int) -> tuple[float, float]:
        """``(p50, p95)`` ms the running batch adds to this prompt's prefill (>= 0)."""
        kw: dict[str, Any] = dict(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                                  prefix_tokens=prefix_tokens, chunk_tokens=self.chunk_tokens,
                                  step_token_budget=self.step_token_budget)
        alone = predict_batched_ttft_ms(self.fit, decode_contexts=(), **kw)
        batch = predict_batched_ttft_ms(self.fit, decode_contexts=self.decode_contexts,
                                        prefills_ahead=self.prefills_ahead, **kw)
        return max(batch[0] - alone[0], 0.0), max(batch[1] - alone[1], 0.0)

    def predict_ttft_many(self, prompt_tokens: ArrayLike, cached_tokens: ArrayLike,
                          prefix_tokens: ArrayLike | None = None
                          ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """``((N,) p50 ms, (N,) p95 ms)``: the base band plus :meth:`batch_extra_ms` per row."""
        p50, p95 = self.base.predict_ttft_many(prompt_tokens, cached_tokens, prefix_tokens)
        n = np.atleast_1d(np.asarray(prompt_tokens, dtype=np.int64))  # (N,)
        c = np.broadcast_to(np.atleast_1d(np.asarray(cached_tokens, dtype=np.int64)), n.shape)  # (N,)
        p = c if prefix_tokens is None else np.broadcast_to(
            np.atleast_1d(np.asarray(prefix_tokens, dtype=np.int64)), n.shape)  # (N,)
        extra = np.array([self.batch_extra_ms(int(a), int(b), int(d))
                          for a, b, d in zip(n, c, p, strict=True)], dtype=np.float64)
        extra = extra.reshape(-1, 2)  # (N, 2)
        return (np.asarray(p50 + extra[:, 0], dtype=np.float64),
                np.asarray(p95 + extra[:, 1], dtype=np.float64))

    def predict_ttft_ms(self, prompt_tokens: int, cached_tokens: int,
                        prefix_tokens: int | None = None) -> tuple[float, float]:
        """``(p50, p95)`` ms of one prompt (see :meth:`predict_ttft_many`)."""
        p50, p95 = self.predict_ttft_many([prompt_tokens], [cached_tokens],
                                          None if prefix_tokens is None else [prefix_tokens])
        return float(p50[0]), float(p95[0])
