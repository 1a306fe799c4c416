"""Up to ``slots`` generations at a time per model, behind a bounded FIFO queue.

``slots`` is 1 for a backend that runs one answer at a time, and the local
engine's ``max_running`` when it batches answers (``generation.scheduler``).
A request waits in arrival order for a slot; when all slots are taken and
``queue_max`` requests are already waiting, a new one is refused at once with
:class:`Busy` (HTTP 429, its Retry-After the predicted wait:
:meth:`GenerationQueue.retry_after_ms`). A waiting request whose client goes away
(``cancel`` set) leaves the queue and frees its place.

Each place may carry a :class:`Ticket`, the request's predicted cost on the
model (its prefill and ``max_new_tokens`` decode steps, from the latency
profile); the running answer updates its ticket as tokens come. From these,
:meth:`GenerationQueue.predicted_wait_ms` says how long a request arriving now
would wait: the running answer's remaining decode steps x TPOT plus the
prefills and ``max_new_tokens`` x TPOT of everyone already waiting (an upper
estimate: an answer may stop before ``max_new_tokens``), divided by ``slots``
when several run at once (a rough share), and 0 while a slot is free. What
the running answers add to a new answer's own prefill once it has a slot is
priced in its plan instead (``latency_model.step_model.BatchedBand``, from the
profile's mixed-step model).

Load from other clients (``engine_load``, a remote engine that reports its slots or its
queue metrics: :class:`generation.remote_load.SlotLoad`): the engine's own count of busy slots
and of requests it keeps waiting behind them, minus this queue's running answers, is the work
of clients that bypass ragbudget. Each is priced as a running answer with the mean remaining
time of what ``engine_load`` returns (per busy slot its tokens still allowed, per waiting
request ``default_max_new_tokens``, x the profile's TPOT), so a flooded engine shows a
predicted wait before ragbudget's own answers come back late. They
count in :meth:`GenerationQueue.predicted_wait_ms` and :meth:`GenerationQueue.retry_after_ms`
(a slot is free only when the engine's busy slots leave one), not in
:meth:`GenerationQueue.min_wait_ms` (a foreign answer may end at any token: a fast refusal is
never decided on it), and never in admission (the engine queues what it cannot run at once).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from foundation.errors import Busy


class Cancelled(Exception):
    """Raised inside :meth:`GenerationQueue.slot` when the waiter was cancelled."""


@dataclass(eq=False)  # identity, not value: two equal costs are two places
class Ticket:
    """A request's predicted time on the model, ms (profile p50s); updated while it runs.

    ``prefill_ms``: predicted prefill of its prompt; ``tpot_ms``: predicted decode
    step; ``max_new_tokens``: the most steps it may take; ``produced``: steps taken
    so far (the pipeline counts them; a prefill that produced the first token
    counts as started).
    """

    prefill_ms: float = 0.0
    tpot_ms: float = 0.0
    max_new_tokens: int = 0
    produced: int = 0

    def remaining_ms(self) -> float:
        """Predicted time until this request releases the model, ms."""
        if self.produced <= 0:
            return self.prefill_ms + max(self.max_new_tokens - 1, 0) * self.tpot_ms
        return max(self.max_new_tokens - self.produced, 0) * self.tpot_ms

    def min_remaining_ms(self) -> float:
        """The least it may still hold the model, ms: its prefill if not yet done (it may stop
        right after its first token), else nothing."""
        return self.prefill_ms if self.produced <= 0 else 0.0


class GenerationQueue:
    """A FIFO semaphore of ``slots`` places with a bounded waiting line.

    Args:
        queue_max: how many requests may wait while all slots run (0: none may wait).
        retry_after_s: the least Retry-After given with :class:`Busy`, s; the hint is the
            queue's own predicted wait (:meth:`retry_after_ms`) when that is longer.
        slots: generations running at once (>= 1).

    Raises:
        ValueError: ``slots < 1``.
    """

    def __init__(self, queue_max: int, retry_after_s: float = 1.0, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.queue_max = queue_max
        self.retry_after_s = retry_after_s
        self.slots = slots
        self._cond = threading.Condition()
        self._waiting: deque[object] = deque()
        self._running_places: list[object] = []
        #: Remaining ms of every slot the engine reports busy (its own count, ragbudget's answers
        #: included), or None when it reports none (see the module docstring).
        self.engine_load: Callable[[], list[float] | None] | None = None

    @property
    def _running(self) -> bool:
        return bool(self._running_places)

    def _full(self) -> bool:
        return len(self._running_places) >= self.slots

    def full(self) -> bool:
        """True when a request arriving now would be refused with :class:`Busy` (every slot runs
        and ``queue_max`` wait)."""
        with self._cond:
            return self._full() and len(self._waiting) >= self.queue_max

    @property
    def depth(self) -> int:
        """Requests waiting now (not counting the one running)."""
        with self._cond:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        """True while at least one generation runs."""
        with self._cond:
            return self._running

    def foreign(self) -> list[float]:
        """Remaining ms of each engine slot held by a client that bypasses this queue: the
        engine's busy slots beyond this queue's running answers, each priced at the mean of
        the busy slots' remaining time (module docstring); ``[]`` without an ``engine_load``."""
        load = self.engine_load() if self.engine_load is not None else None
        if not load:
            return []
        with self._cond:
            own = len(self._running_places)
        n = max(len(load) - own, 0)
        return [float(sum(load)) / len(load)] * n

    def engine_wait_ms(self) -> float:
        """For a request that holds a place but has not been sent to the engine yet: how long the
        engine itself will keep it waiting because other clients hold its slots, ms. The engine's
        busy slots beyond this queue's other running answers are foreign; when they and those
        answers leave no slot for this one, it waits for as many foreign answers as it is over,
        each at the mean remaining time of the busy slots, shared over the slots. 0 without an
        ``engine_load``."""
        load = self.engine_load() if self.engine_load is not None else None
        if not load:
            return 0.0
        with self._cond:
            sent = max(len(self._running_places) - 1, 0)
        foreign = max(len(load) - sent, 0)
        over = sent + foreign + 1 - self.slots
        if over <= 0 or foreign == 0:
            return 0.0
        return float(sum(load)) / len(load) * min(over, foreign) / self.slots

    def _tickets(self) -> tuple[list[Ticket], list[Ticket] | None, list[float]]:
        """One snapshot under the lock: ``(running tickets, waiting tickets, foreign slots' remaining
        ms)``, the second None while a place is free (the engine's foreign load counted) and no one
        waits (nothing to wait for). Places without a :class:`Ticket` are left out (their cost is
        unknown)."""
        foreign = self.foreign()
        with self._cond:
            running = [t for t in self._running_places if isinstance(t, Ticket)]
            if len(self._running_places) + len(foreign) < self.slots and not self._waiting:
                return running, None, foreign
            return running, [t for t in self._waiting if isinstance(t, Ticket)], foreign

    def predicted_wait_ms(self) -> float:
        """How long a request arriving now would wait for the model, ms (see the module docstring).

        Places without a :class:`Ticket` count 0 (their cost is unknown).
        """
        running, waiting, foreign = self._tickets()
        if waiting is None:
            return 0.0
        return float(sum(t.remaining_ms() for t in running + waiting) + sum(foreign)) / self.slots

    def min_wait_ms(self) -> float:
        """A lower bound of that wait, ms: the prefills still ahead, as if every answer ahead
        stopped at its first token. What a fast refusal is decided on, so that a request the
        model could have served in time is not refused on a pessimistic guess."""
        running, waiting, _foreign = self._tickets()
        if waiting is None:
            return 0.0
        return float(sum(t.min_remaining_ms() for t in running + waiting)) / self.slots

    def retry_after_ms(self) -> float:
        """When a request refused now should come back, ms: the predicted wait
        (:meth:`predicted_wait_ms`) when every place is taken, else the least predicted time
        until one running answer releases its place (the batch it would join then shrinks);
        0 when nothing with a :class:`Ticket` runs. What a fast refusal's ``Retry-After`` says.
        Both read from one snapshot of the queue."""
        running, waiting, foreign = self._tickets()
        left = [t.remaining_ms() for t in running] + foreign
        wait = 0.0 if waiting is None else (sum(left) + sum(t.remaining_ms() for t in waiting)) / self.slots
        return float(max(wait, min(left, default=0.0)))

    @contextmanager
    def slot(self, cancel: threading.Event | None = None,
             ticket: Ticket | None = None) -> Iterator[float]:
        """Wait for the model; yield the queue wait in ms; release on exit.

        ``ticket``: this request's predicted cost, counted in the predicted wait of
        those behind it (and, once it runs, updated by the caller as tokens come).

        Raises:
            Busy: the waiting line is full; ``retry_after_s`` is the predicted wait until the
                running and waiting answers have released the model (:meth:`retry_after_ms`),
                at least the queue's ``retry_after_s``.
            Cancelled: ``cancel`` was set while waiting (the place is freed).
        """
        t0 = time.perf_counter()
        token: object = ticket if ticket is not None else object()
        with self._cond:
            if self._full() and len(self._waiting) >= self.queue_max:
                wait_ms = self.retry_after_ms()  # the line ahead drained: room for the retry
                raise Busy(f"generation queue is full ({self.queue_max} waiting); predicted wait "
                           f"{wait_ms / 1000.0:.1f} s",
                           retry_after_s=max(self.retry_after_s, wait_ms / 1000.0),
                           queue_max=self.queue_max, predicted_wait_ms=wait_ms)
            self._waiting.append(token)
            try:
                while self._full() or self._waiting[0] is not token:
                    if cancel is not None and cancel.is_set():
                        raise Cancelled()
                    self._cond.wait(timeout=0.05)
            except BaseException:
                self._waiting.remove(token)
                self._cond.notify_all()
                raise
            self._waiting.popleft()
            self._running_places.append(token)
        try:
            yield (time.perf_counter() - t0) * 1000.0
        finally:
            with self._cond:
                self._running_places.remove(token)
                self._cond.notify_all()
