"""What the engine tells its readers, as frozen dataclasses.

* :class:`StepRecord`: one timed step of the step log (``Engine.recent_steps``), read by the
  planner against the step model (``latency_model.step_model.machine_speed``).

This module imports nothing of the project, so the latency model and the app can share these
types without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """One timed engine step: ``t_end`` (``time.perf_counter`` s) when it ended, ``segments``
    ``(new tokens, start position)`` per answer in it, ``logit_rows`` rows that needed logits,
    ``ms`` its wall time (packing, forward, token routing)."""

    t_end: float
    segments: tuple[tuple[int, int], ...]
    logit_rows: int
    ms: float
