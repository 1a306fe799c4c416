"""What the engine tells its readers, as frozen dataclasses (no tuple protocols).

* Events, one queue per answer (``Request.out``), in this order: :class:`Admitted` once, when
  the answer joins the running batch; a :class:`Token` per generated token; a final
  :class:`Finished`. :data:`EngineEvent` is their union.
* :class:`BatchSnapshot`: what a new answer would share steps with now
  (``Engine.batch_snapshot``): the answers :class:`Decoding` and the answers
  :class:`Prefilling`, in prefill order. The planner reads it (``app.answering.bands``) and the
  latency model's batch replay takes its entries (``latency_model.step_model``).
* :class:`StepRecord`: one timed step of the step log (``Engine.recent_steps``), read by the
  planner against the step model (``latency_model.step_model.machine_speed``).

This module imports nothing of the project, so the latency model and the app can share these
types without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: Why an answer ended (``generation.base.FinishReason`` says the same).
EndReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class Admitted:
    """The answer joined the running batch at ``start_t`` (``time.perf_counter`` s) with
    ``cached_tokens`` of its prompt taken from the prefix cache."""

    start_t: float
    cached_tokens: int


@dataclass(frozen=True)
class Token:
    """One generated token: its id and ``t`` (``time.perf_counter`` s) when it was chosen."""

    token_id: int
    t: float


@dataclass(frozen=True)
class Finished:
    """The answer ended: ``reason`` is ``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"``;
    ``error`` the exception that ended it (``"error"`` only), else None."""

    reason: EndReason
    error: BaseException | None = None


#: Everything the engine puts on an answer's queue.
EngineEvent = Admitted | Token | Finished


@dataclass(frozen=True)
class Decoding:
    """A running answer that is decoding: ``context_tokens`` in its KV, ``steps_left`` decode
    steps until it reaches its ``max_new`` (fewer if it stops at an end-of-text token);
    None: not known (unbounded)."""

    context_tokens: int
    steps_left: int | None = None


@dataclass(frozen=True)
class Prefilling:
    """An answer still prefilling (admitted, or waiting in the engine's queue): ``tokens_left``
    prompt tokens to prefill from position ``position``, ``max_new`` tokens it may produce
    (None: not known), ``order`` its prefill order (None: none yet)."""

    tokens_left: int
    position: int
    max_new: int | None = None
    order: int | None = None


@dataclass(frozen=True)
class BatchSnapshot:
    """The engine's batch at one moment: each answer decoding (batch order) and each answer
    prefilling (prefill order)."""

    decoding: tuple[Decoding, ...] = ()
    prefilling: tuple[Prefilling, ...] = ()


@dataclass(frozen=True)
class StepRecord:
    """One timed engine step: ``t_end`` (``time.perf_counter`` s) when it ended, ``segments``
    ``(new tokens, start position)`` per answer in it, ``logit_rows`` rows that needed logits,
    ``ms`` its wall time (packing, forward, token routing)."""

    t_end: float
    segments: tuple[tuple[int, int], ...]
    logit_rows: int
    ms: float
