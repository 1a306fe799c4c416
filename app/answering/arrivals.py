"""The requests that have arrived and are not yet granted the model, and the room an answer
planned now leaves them.

One :class:`Arrivals` per :class:`app.answering.pipeline.AnswerPipeline`. A request that will answer is
counted from its arrival (:meth:`Arrivals.arrive`) until it is granted the model, refused or
fails (:meth:`Arrivals.left`). The engine prefills answers in the order they were granted, so
the first of several requests arriving together, bound alone, could take every chunk its
budget allows and leave those behind it too little time to answer even with k = 0. With the
pipeline's ``room_for_arrivals`` switch (and late binding), an answer's k is capped so every
counted arrival keeps room to answer (:meth:`Arrivals.room`), each priced behind it by
:meth:`app.answering.bands.PlanBands.behind` (the step model under the online correction).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from generation.engine.messages import Prefilling
from latency_model.planner import Plan, PrefillBand, chunking_prefix

if TYPE_CHECKING:
    from app.answering.bands import Entry
    from app.answering.state import Prepared
    from latency_model.profile import Profile


@dataclass(frozen=True)
class Arrival:
    """A request that has arrived and is not yet granted the model: its ``key``
    (:meth:`Arrivals.arrive`), ``arrival_t`` (``perf_counter`` seconds), TTFT ``budget_ms`` and
    ``max_new_tokens``."""

    key: int
    arrival_t: float
    budget_ms: float
    max_new_tokens: int


class Pricer(Protocol):
    """What prices a prefill behind the running batch (:class:`app.answering.bands.PlanBands`)."""

    def behind(self, profile: Profile) -> Callable[[Sequence[Entry]], PrefillBand] | None:
        """See :meth:`app.answering.bands.PlanBands.behind`."""


class Arrivals:
    """The requests arrived and not yet granted the model (answers only, not advice), by key.

    Thread-safe: every method takes one lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[int, Arrival] = {}
        self._keys = itertools.count()

    def arrive(self, arrival_t: float, budget_ms: float, max_new_tokens: int) -> int:
        """Count a request that will answer as arrived until it is granted the model; its key
        (removed by :meth:`left`). ``arrival_t``: ``perf_counter`` seconds; ``budget_ms``: its
        TTFT budget; ``max_new_tokens``: its decode length."""
        with self._lock:
            key = next(self._keys)
            self._items[key] = Arrival(key, float(arrival_t), float(budget_ms), int(max_new_tokens))
        return key

    def left(self, key: int | None) -> None:
        """Stop counting the arrival ``key`` (granted the model, refused or failed)."""
        if key is not None:
            with self._lock:
                self._items.pop(key, None)

    def waiting(self, besides: int | None = None) -> list[Arrival]:
        """The requests arrived and not yet granted the model, but ``besides``, oldest first."""
        with self._lock:
            got = [a for k, a in self._items.items() if k != besides]
        return sorted(got, key=lambda a: (a.arrival_t, a.key))

    def room(self, plan: Plan, p: Prepared, spent_ms: float, now_t: float,
             arrival_key: int | None, bands: Pricer) -> Plan:
        """``plan`` with k capped so every request arrived and not yet granted keeps room to answer.

        The answer's own ``plan`` was made ``spent_ms`` after it arrived, at ``now_t``
        (``perf_counter`` seconds). Each request ``r`` that has arrived (:meth:`waiting`, oldest
        first, ``arrival_key`` excluded) will prefill after this answer and after the ones
        before it. Its TTFT with k = 0 is predicted as ``spent_r + p95_r``: ``spent_r`` the
        larger of the time since it arrived and this answer's own ``spent_ms`` (it still has
        retrieval and planning ahead); ``p95_r`` its prefill at p95 behind this answer's chosen
        prompt and the others before it (``bands.behind``; its prompt taken as long as this
        answer's k = 0 prompt, each before it at k = 0). The chosen k is the largest (binary
        search; predictions grow with k) at which every counted ``r`` fits its budget; ``r``
        that would not fit even with this answer at k = 0 are not counted (nothing this plan
        does saves them). Unchanged when nothing is waiting, k is already 0 or None, or there
        is no batching engine with a step model to price it; else binding ``arrivals``.
        """
        k_max = plan.chosen_k
        others = self.waiting(besides=arrival_key)
        if not others or not k_max:
            return plan
        rows, scaffold = plan.rows, int(p.full_prompt.scaffold_len)
        own0 = rows[0]

        price = bands.behind(p.profile)
        if price is None:
            return plan

        def miss(k: int, counted: list[Arrival]) -> list[Arrival]:
            """The counted arrivals that miss with this answer at ``k``."""
            assert price is not None
            row = rows[k]
            extra: list[Entry] = [Prefilling(row.computed_tokens, row.cached_tokens, p.max_new_tokens)]
            missed = []
            for r in counted:
                p95 = float(price(extra).predict_ttft_many(
                    [own0.prompt_tokens], [own0.cached_tokens],
                    [chunking_prefix(scaffold, own0.cached_tokens)])[1][0])
                if max((now_t - r.arrival_t) * 1000.0, spent_ms) + p95 > r.budget_ms:
                    missed.append(r)
                extra.append(Prefilling(own0.computed_tokens, own0.cached_tokens, r.max_new_tokens))
            return missed

        counted = list(others)
        while counted:  # drop those k = 0 cannot save; dropping one only helps the rest
            lost = miss(0, counted)
            if not lost:
                break
            counted = [r for r in counted if r not in lost]
        if not counted or not miss(k_max, counted):
            return plan
        lo, hi = 0, k_max  # lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if miss(mid, counted):
                hi = mid
            else:
                lo = mid
        n = len(counted)
        return replace(plan, chosen_k=lo, binding="arrivals",
                       message=(f"k={lo}: one more chunk would leave {'one of the ' if n > 1 else 'the '}"
                                f"{n} request{'s' if n > 1 else ''} that arrived meanwhile too little "
                                f"prefill time to answer within {'its' if n == 1 else 'their'} budget"))
