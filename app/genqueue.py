"""One generation at a time per local model, behind a bounded FIFO queue.

A request waits in arrival order for the model; when ``queue_max`` requests
are already waiting, a new one is refused at once with :class:`Busy` (HTTP
429 with Retry-After). A waiting request whose client goes away (``cancel``
set) leaves the queue and frees its place.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from foundation.errors import Busy


class Cancelled(Exception):
    """Raised inside :meth:`GenerationQueue.slot` when the waiter was cancelled."""


class GenerationQueue:
    """A FIFO mutex with a bounded waiting line.

    Args:
        queue_max: how many requests may wait while one runs (0: none may wait).
        retry_after_s: the Retry-After hint given with :class:`Busy`.
    """

    def __init__(self, queue_max: int, retry_after_s: float = 2.0) -> None:
        self.queue_max = queue_max
        self.retry_after_s = retry_after_s
        self._cond = threading.Condition()
        self._waiting: deque[object] = deque()
        self._running = False

    @property
    def depth(self) -> int:
        """Requests waiting now (not counting the one running)."""
        with self._cond:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        """True while a generation holds the model."""
        with self._cond:
            return self._running

    @contextmanager
    def slot(self, cancel: threading.Event | None = None) -> Iterator[float]:
        """Wait for the model; yield the queue wait in ms; release on exit.

        Raises:
            Busy: the waiting line is full.
            Cancelled: ``cancel`` was set while waiting (the place is freed).
        """
        t0 = time.perf_counter()
        token = object()
        with self._cond:
            if self._running and len(self._waiting) >= self.queue_max:
                raise Busy(f"generation queue is full ({self.queue_max} waiting)",
                           retry_after_s=self.retry_after_s, queue_max=self.queue_max)
            self._waiting.append(token)
            try:
                while self._running or self._waiting[0] is not token:
                    if cancel is not None and cancel.is_set():
                        raise Cancelled()
                    self._cond.wait(timeout=0.05)
            except BaseException:
                self._waiting.remove(token)
                self._cond.notify_all()
                raise
            self._waiting.popleft()
            self._running = True
        try:
            yield (time.perf_counter() - t0) * 1000.0
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()
