"""What the next engine step carries: a pure function of the answers' positions.

:func:`schedule` turns the answers in the running batch into a :class:`StepPlan`: the next
decode token of every answer that is decoding, then prefill chunks in prefill order (a
number each answer takes when it is submitted, as it is planned) while the step's
tokens stay within ``step_token_budget``; at least one chunk always goes, and the first
chunk that does not fit ends the step's prefill, so an answer never overtakes one planned
before it. Prefill chunk boundaries (:func:`next_chunk`) are a pure function of the prompt:
the scaffold ``[0, P)`` in chunks of ``chunk`` from 0, the rest ``[P, N)`` in chunks of
``chunk`` from ``P``. :func:`padded_rows` is the row count a step of ``n`` real rows runs
with (batch invariance, docs/receipts.md); :func:`admissions` how many waiting answers join.

This module holds no torch and does no I/O: the engine core
(:mod:`generation.engine.core`) and the latency model's replay of the engine's steps
(``latency_model.step_model.batched_step_shapes``) both call it, so the steps the planner
prices are the steps the engine runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

#: On CPU a step (and the LM head) is padded to at least MIN_ROWS rows, in multiples of
#: ROW_MULTIPLE: below that MKL sgemm takes other kernels and a row's bits change with the
#: row count (measured, docs/receipts.md).
MIN_ROWS = 16
ROW_MULTIPLE = 8


def padded_rows(n: int, fixed: int | None = None, min_rows: int = MIN_ROWS,
                multiple: int = ROW_MULTIPLE) -> int:
    """Rows a step of ``n`` real rows runs with: ``fixed`` when given (and ``>= n``), else
    ``n`` rounded up to a multiple of ``multiple`` (:data:`ROW_MULTIPLE`), at least
    ``min_rows`` (:data:`MIN_ROWS`)."""
    if fixed is not None and fixed >= n:
        return fixed
    return max(min_rows, -(-n // multiple) * multiple)


def next_chunk(pos: int, prompt_len: int, prefix_len: int, chunk: int) -> tuple[int, int]:
    """``[start, end)`` of the next prefill chunk of a prompt of ``prompt_len`` tokens whose
    first ``pos`` are in its KV: up to ``chunk`` tokens, never across the scaffold boundary
    ``prefix_len``."""
    limit = prefix_len if pos < prefix_len else prompt_len
    return pos, min(limit, pos + chunk)


class Schedulable(Protocol):
    """What :func:`schedule` reads of an answer (``generation.engine.request.Request`` has it)."""

    @property
    def pos(self) -> int:
        """Tokens in the answer's KV (its next position)."""
        ...

    @property
    def prompt_len(self) -> int:
        """Tokens in its prompt."""
        ...

    @property
    def prefix_len(self) -> int:
        """Tokens of its scaffold (chunks never cross it)."""
        ...

    @property
    def chunk(self) -> int:
        """Its prefill chunk size, tokens."""
        ...

    @property
    def order(self) -> int | None:
        """Its prefill order (None: -1, before every answer that has one)."""
        ...

    @property
    def decode_ready(self) -> bool:
        """True when its next step is a decode step."""
        ...


@dataclass(frozen=True)
class ScheduledChunk:
    """One answer's part of a step: ``tokens`` new tokens at positions ``[start, start +
    tokens)`` of the answer at ``index`` in the list given to :func:`schedule`; ``decode``:
    its next decode token (else a prefill chunk); ``needs_logits``: the step must compute its
    last row's logits (a decode token, or a chunk that ends the prompt or the scaffold)."""

    index: int
    start: int
    tokens: int
    needs_logits: bool
    decode: bool


@dataclass(frozen=True)
class StepPlan:
    """One step: its chunks in row order (decode tokens first, then prefill chunks in prefill
    order)."""

    chunks: tuple[ScheduledChunk, ...]

    @property
    def tokens(self) -> int:
        """Real rows of the step (tokens it carries)."""
        return sum(c.tokens for c in self.chunks)

    @property
    def logit_rows(self) -> int:
        """Rows whose logits the step computes (before padding)."""
        return sum(1 for c in self.chunks if c.needs_logits)

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """``(new tokens, start position)`` per answer, in row order (the step log's shape)."""
        return tuple((c.tokens, c.start) for c in self.chunks)

    def rows(self, fixed: int | None = None) -> int:
        """Rows the step runs with (:func:`padded_rows` of :attr:`tokens`)."""
        return padded_rows(self.tokens, fixed)

    def head_rows(self, fixed: int | None = None) -> int:
        """Rows the LM head runs on: :attr:`logit_rows` padded like a step; 0 when none."""
        n = self.logit_rows
        return padded_rows(n, fixed) if n else 0


def _order(req: Schedulable) -> int:
    """``req``'s prefill order (-1 before it has one: an answer run alone by ``run_alone``)."""
    return req.order if req.order is not None else -1


def admissions(running: int, waiting: int, max_running: int) -> int:
    """How many of ``waiting`` answers (oldest first) join a batch of ``running`` answers:
    as many as fit under ``max_running``."""
    return max(0, min(waiting, max_running - running))


def schedule(requests: Sequence[Schedulable], step_token_budget: int | None) -> StepPlan:
    """The next step of ``requests`` (the live answers of the running batch, in batch order).

    Every answer that is decoding contributes its next token, in batch order; then the answers
    still prefilling contribute their next chunk (:func:`next_chunk`), in prefill order, while
    the step's tokens stay within ``step_token_budget``: the first chunk always goes, the first
    that does not fit ends the step's prefill. ``None``: one chunk a step.
    """
    chunks: list[ScheduledChunk] = []
    for i, req in enumerate(requests):
        if req.decode_ready:
            chunks.append(ScheduledChunk(i, req.pos, 1, True, True))
    used = len(chunks)
    took_chunk = False
    # Prefill chunks in prefill order (taken when each answer was planned and submitted), and the first
    # that does not fit ends the step's prefill: an answer planned later never overtakes one
    # planned before it, so a plan made beside the batch holds whoever arrives after it.
    prefilling = sorted((i for i, r in enumerate(requests) if r.pos < r.prompt_len),
                        key=lambda i: _order(requests[i]))
    for i in prefilling:
        req = requests[i]
        start, end = next_chunk(req.pos, req.prompt_len, req.prefix_len, req.chunk)
        if took_chunk and (step_token_budget is None or used + (end - start) > step_token_budget):
            break
        chunks.append(ScheduledChunk(i, start, end - start,
                                     end == req.prompt_len or end == req.prefix_len, False))
        used += end - start
        took_chunk = True
    return StepPlan(tuple(chunks))
