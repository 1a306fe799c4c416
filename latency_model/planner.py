"""The TTFT-budget planner: how many ranked chunks fit a time-to-first-token budget.

For every ``k`` from 0 to ``len(chunk_tokens)`` the planner lays out the prompt
as ``[scaffold][chunks 1..k][question][extra]`` (docs/architecture.md, "Data flow"), predicts its
prefill time at p50 and p95 from a :class:`~latency_model.profile.Profile`, and
checks it against the budget and the context window. Chunks are taken in rank
order only: reordering would change what a replay rebuilds.

Chosen ``k``: the largest ``k`` such that every row ``0..k`` has
``ttft_p95_ms + overhead_ms <= budget_ms`` and
``prompt_tokens + max_new_tokens <= context_window``. (Predictions grow with
``k``, so this is the largest feasible ``k``; requiring the whole prefix to fit
keeps the answer sensible even for a non-monotone profile.)

Cached tokens per ``k``: the local engine's prefix cache holds token blocks beyond the
scaffold (retrieved chunks, earlier turns: ``generation.engine.kv_cache.BlockPrefixCache``).
The caller looks up, for each candidate prompt ``k = 0..K``, how many of its leading tokens
an admission now would load (``cached_tokens``), and each row is priced with them: ``m = n - c``
tokens computed, the engine resuming its chunked prefill at ``c``. A cached chain always ends on
the engine's chunk grid (the scaffold's chunks, then chunks from the scaffold's end), so
prefilling on from ``c`` runs exactly the chunks a cold prefill runs after ``c``: the chunking
boundary the prefill model reads is ``max(scaffold, c)`` (:func:`chunking_prefix`). Without
per-k counts only the scaffold counts as cached (``scaffold_cached``), as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

from foundation.errors import InvalidInput

BINDINGS = ("budget", "context_window", "candidates_exhausted", "nothing_fits", "arrivals")


class PrefillBand(Protocol):
    """What the planner reads of a profile: its id and source and the prefill p50/p95 band.

    A :class:`~latency_model.profile.Profile`, or one under an online correction
    (:class:`~latency_model.correction.CorrectedProfile`).
    """

    @property
    def id(self) -> str:
        """The profile's content id (``sha256:...``)."""
        ...

    @property
    def source(self) -> str:
        """``fitted`` or ``prior``."""
        ...

    def predict_ttft_many(self, prompt_tokens: ArrayLike, cached_tokens: ArrayLike,
                          prefix_tokens: ArrayLike | None = None
                          ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """``((N,) p50 ms, (N,) p95 ms)`` of prefill for each (prompt, cached) pair, the engine
        chunking at ``prefix_tokens`` (the scaffold boundary; default the cached length)."""
        ...


@dataclass(frozen=True)
class PlanRow:
    """One candidate ``k``: token counts and predicted TTFT (ms) of its prompt."""

    k: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    fits_budget: bool
    fits_context: bool


@dataclass(frozen=True)
class Plan:
    """The per-k table, the choice and why.

    ``chosen_k`` is ``None`` only when even ``k = 0`` does not fit; then
    ``binding == "nothing_fits"`` and ``min_feasible_budget_ms`` is the
    smallest budget at which ``k = 0`` would fit (``None`` when the question
    alone overflows the context window, which no budget can fix).
    """

    rows: list[PlanRow]
    chosen_k: int | None
    binding: str
    min_feasible_budget_ms: float | None
    budget_ms: float
    overhead_ms: float
    max_new_tokens: int
    context_window: int
    profile_id: str
    profile_source: str
    message: str

    @property
    def chosen(self) -> PlanRow | None:
        """The chosen row, or ``None`` when nothing fits."""
        return None if self.chosen_k is None else self.rows[self.chosen_k]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: every field, rows as dicts, plus ``budget_used_fraction`` (p95 based)."""
        out = asdict(self)
        chosen = self.chosen
        out["budget_used_fraction"] = (None if chosen is None
                                       else (chosen.ttft_p95_ms + self.overhead_ms) / self.budget_ms)
        return out


def chunking_prefix(scaffold_tokens: int, cached_tokens: int) -> int:
    """The ``prefix_tokens`` argument of the prefill model for a prompt whose first ``cached_tokens``
    come from the cache: ``max(scaffold_tokens, cached_tokens)`` (tokens).

    The engine prefills the uncached part of the scaffold in its own chunks and the rest in chunks
    from ``max(scaffold, cached)`` (``latency_model.step_model.prefill_schedule``); a chain cached
    past the scaffold ends on that grid, so resuming there is the cold schedule's tail.
    """
    return max(int(scaffold_tokens), int(cached_tokens))


def _check_count(name: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInput(f"{name} must be an integer >= {minimum}", field=name)
    return value


def _cached_per_row(prompts: list[int], scaffold_tokens: int, scaffold_cached: bool,
                    cached_tokens: Sequence[int] | None) -> list[int]:
    """Cached tokens of each row's prompt (see :func:`plan`).

    Raises:
        InvalidInput: ``field`` ``cached_tokens``: not one count per row, a count that is not an
            integer >= 0, or one above its prompt's tokens.
    """
    if cached_tokens is None:
        return [scaffold_tokens if scaffold_cached else 0] * len(prompts)
    out = list(cached_tokens)
    if len(out) != len(prompts):
        raise InvalidInput(f"cached_tokens needs one count per k (0..{len(prompts) - 1}), got {len(out)}",
                           field="cached_tokens")
    for k, (c, n) in enumerate(zip(out, prompts, strict=True)):
        _check_count(f"cached_tokens[{k}]", c)
        if c > n:
            raise InvalidInput(f"cached_tokens[{k}] = {c} exceeds that prompt's {n} tokens",
                               field="cached_tokens")
    return [int(c) for c in out]


def plan(*, question_tokens: int, scaffold_tokens: int, scaffold_cached: bool,
         chunk_tokens: list[int], budget_ms: float, profile: PrefillBand, max_new_tokens: int,
         context_window: int, overhead_ms: float = 0.0, extra_tokens: int = 0,
         cached_tokens: Sequence[int] | None = None) -> Plan:
    """Choose how many ranked chunks fit ``budget_ms`` at p95 and the context window.

    Args:
        question_tokens: tokens of the question as laid out in the prompt.
        scaffold_tokens: tokens of the stable scaffold placed first.
        scaffold_cached: the scaffold is served from the prefix KV cache.
        chunk_tokens: token count of each candidate chunk, in rank order (as laid out).
        budget_ms: TTFT budget in ms (finite, > 0).
        profile: latency profile of the generator on this device (possibly corrected online).
        max_new_tokens: tokens the answer may generate (must fit the window too).
        context_window: the model's maximum sequence length in tokens.
        overhead_ms: time before prefill, >= 0: measured so far (auth, retrieval, tokenisation,
            queue wait) plus, when planning before the request has the model, its predicted wait.
        extra_tokens: template/label tokens outside scaffold, chunks and question, counted exactly.
        cached_tokens: per ``k = 0..len(chunk_tokens)``, the tokens of that ``k``'s prompt the
            engine's prefix cache holds now (a leading run, scaffold included); overrides
            ``scaffold_cached``. None: the scaffold alone when ``scaffold_cached``.

    Returns:
        A :class:`Plan`; never raises because nothing fits (see ``binding``).

    Raises:
        InvalidInput: a count is negative or not an integer, or budget/overhead not finite,
        budget <= 0, overhead < 0; ``cached_tokens`` not one count per row, or a count above its
        prompt's tokens (``field`` ``cached_tokens``).
    """
    for name, value in (("question_tokens", question_tokens), ("scaffold_tokens", scaffold_tokens),
                        ("max_new_tokens", max_new_tokens), ("extra_tokens", extra_tokens)):
        _check_count(name, value)
    _check_count("context_window", context_window, 1)
    for i, t in enumerate(chunk_tokens):
        _check_count(f"chunk_tokens[{i}]", t)
    if not isinstance(budget_ms, int | float) or not math.isfinite(budget_ms) or budget_ms <= 0:
        raise InvalidInput("budget_ms must be a finite number > 0", field="budget_ms")
    if not isinstance(overhead_ms, int | float) or not math.isfinite(overhead_ms) or overhead_ms < 0:
        raise InvalidInput("overhead_ms must be a finite number >= 0", field="overhead_ms")

    base = scaffold_tokens + question_tokens + extra_tokens
    prompts = [base]
    for t in chunk_tokens:
        prompts.append(prompts[-1] + t)
    cached = _cached_per_row(prompts, scaffold_tokens, scaffold_cached, cached_tokens)
    # The engine chunks at the scaffold boundary whether or not it is cached (generation.scheduler),
    # so a miss is predicted as (n, 0, prefix=scaffold): one forward pass more than a hit; past
    # the scaffold it resumes at the cached chain's end (chunking_prefix).
    p50s, p95s = profile.predict_ttft_many(prompts, cached,
                                           [chunking_prefix(scaffold_tokens, c) for c in cached])
    rows = [PlanRow(k=k, prompt_tokens=n, cached_tokens=c, computed_tokens=n - c,
                    ttft_p50_ms=float(p50), ttft_p95_ms=float(p95),
                    fits_budget=bool(p95 + overhead_ms <= budget_ms),
                    fits_context=bool(n + max_new_tokens <= context_window))
            for k, (n, c, p50, p95) in enumerate(zip(prompts, cached, p50s, p95s, strict=True))]

    chosen: int | None = None
    for row in rows:
        if not (row.fits_budget and row.fits_context):
            break
        chosen = row.k
    min_budget: float | None = None
    if chosen is None:
        binding = "nothing_fits"
        first = rows[0]
        if first.fits_context:
            min_budget = first.ttft_p95_ms + overhead_ms
            message = (f"even k=0 needs about {min_budget:.0f} ms at p95 "
                       f"(prefill {first.ttft_p95_ms:.0f} ms + overhead {overhead_ms:.0f} ms), "
                       f"over the {budget_ms:.0f} ms budget")
        else:
            message = (f"the prompt without chunks ({first.prompt_tokens} tokens) plus "
                       f"max_new_tokens={max_new_tokens} exceeds the {context_window}-token "
                       f"context window; no budget can fit it")
    elif chosen == len(chunk_tokens):
        binding = "candidates_exhausted"
        message = f"all {chosen} candidates fit the budget and the context window"
    else:
        nxt = rows[chosen + 1]
        binding = "context_window" if not nxt.fits_context else "budget"
        message = (f"k={chosen}: adding chunk {chosen + 1} would exceed the "
                   + ("context window" if binding == "context_window" else
                      f"budget (p95 {nxt.ttft_p95_ms + overhead_ms:.0f} ms > {budget_ms:.0f} ms)"))
    return Plan(rows=rows, chosen_k=chosen, binding=binding, min_feasible_budget_ms=min_budget,
                budget_ms=float(budget_ms), overhead_ms=float(overhead_ms),
                max_new_tokens=max_new_tokens, context_window=context_window,
                profile_id=profile.id, profile_source=profile.source, message=message)
