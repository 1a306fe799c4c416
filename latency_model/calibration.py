"""Calibration: time real prefills and decode steps over a grid, fit a profile.

The room's edge: this module drives a :class:`PrefillTimer` (the local
generator, a remote engine measured from the client side, or a fake in tests)
and reads the clock only through it, in the order :mod:`latency_model.grid`
designs (warm-ups, then fit, fresh and decode points shuffled with a seeded RNG,
then mixed-step shapes). Fresh points are measured in the same interleaved run
but never fitted. Every raw sample, warm-ups included, is kept in the profile.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np

from foundation.errors import BackendError
from foundation.provenance import software_versions, utc_now_iso
from latency_model.fitting import coverage, finite_or_none, fit_decode, fit_prefill, mape, select_prefill
from latency_model.grid import CalibrationGrid, StepPoint, engine_chunk_tokens, schedule, step_design
from latency_model.profile import Profile, profile_dtype
from latency_model.roofline import build_prior, datasheet_peaks

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
        dtype=profile_dtype(identity),
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
