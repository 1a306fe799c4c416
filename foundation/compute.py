"""One thread for all of the process's torch work: model loads, engine steps, timers, embeddings.

Why one thread: PyTorch's CPU wheel runs intra-op parallelism on OpenMP (its bundled
libgomp). Every OS thread that runs a parallel region gets its own team of worker threads,
and they live as long as that thread does. Once the process holds more OpenMP threads than
CPUs, libgomp gives every idle worker its short "throttled" spin count, so each parallel
region after a gap of microseconds pays a futex wake-up per worker. A transformer step is
hundreds of small parallel regions (norms, activations, adds), so on a 2-core machine a
prefill run on a second thread after the main thread had its own team took 1.56x as long as
the same prefill before (1748 vs 1119 ms median, 906 tokens, Intel Xeon, 2 cores;
``benchmarks/omp_pools.py``, docs/benchmarks.md "Calibration's thread and the engine's
thread"). Calibration timed prefills on the caller's thread while answers ran on the
engine's thread, so the profile described a faster machine than the one answers ran on.

So every torch call of the process goes through :func:`call` (or a function wrapped by
:func:`on_compute_thread`) and runs on the one compute thread, with one OpenMP team:
calibration times exactly what answers run on. The answer engine
(``generation.scheduler.Engine``) is a *stepper*: between jobs the thread runs one step of
each attached stepper that has work, and jobs (a query embedding, a calibration timer) run
between steps, first come first served, one job between two rounds of steps. A job that
waits for a stepper's progress (e.g. consumes an answer's stream) would wait forever: jobs
never do. A call made on the compute thread itself runs inline.

Not for: the ONNX Runtime / OpenVINO embedders (their own thread pools, set to sleep when
idle), numpy, FAISS (its own OpenMP runtime).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Stepper(Protocol):
    """What the compute thread drives between jobs (``generation.scheduler.Engine``)."""

    def step_once(self) -> bool:
        """Run at most one step; True while work remains (the thread comes back at once)."""
        ...


class ComputeThread:
    """One daemon thread that runs jobs and steppers, in order (see the module docstring).

    Args:
        name: the OS thread's name (``ragbudget-compute``).
    """

    def __init__(self, name: str = "ragbudget-compute") -> None:
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Future[Any], Callable[[], Any]]] = deque()
        self._steppers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._busy = False  # a stepper had work after its last step, or was woken
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # --- public ------------------------------------------------------------------------
    def is_current(self) -> bool:
        """True on the compute thread itself."""
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the compute thread and return its result.

        Blocks the caller until the job has run (after the job or step in progress, and any
        jobs queued before it). Inline when called on the compute thread.

        Raises:
            Whatever ``fn`` raised (re-raised in the caller); RuntimeError when the thread
            has been stopped (process exit).
        """
        if self.is_current():
            return fn(*args, **kwargs)
        fut: Future[T] = Future()
        with self._cond:
            if self._stop:
                raise RuntimeError("the compute thread has stopped (process exit)")
            self._jobs.append((fut, functools.partial(fn, *args, **kwargs)))
            self._cond.notify_all()
        return fut.result()

    def pending(self) -> int:
        """Jobs queued and not started yet (a stepper's low-priority work gives way to them)."""
        return len(self._jobs)

    def attach(self, stepper: Stepper) -> None:
        """Drive ``stepper.step_once()`` between jobs from now on (held by a weak reference:
        a stepper that is gone is dropped)."""
        with self._cond:
            self._steppers.add(stepper)
            self._busy = True
            self._cond.notify_all()

    def detach(self, stepper: Stepper) -> None:
        """Stop driving ``stepper`` (no-op if it was not attached)."""
        with self._cond:
            self._steppers.discard(stepper)

    def wake(self) -> None:
        """A stepper has new work: run a round of steps soon."""
        with self._cond:
            self._busy = True
            self._cond.notify_all()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the job or step in progress; queued jobs fail with RuntimeError. Waits up
        to ``timeout`` seconds for the thread (called at process exit)."""
        with self._cond:
            self._stop = True
            jobs = list(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        for fut, _ in jobs:
            fut.set_exception(RuntimeError("the compute thread has stopped (process exit)"))
        if not self.is_current():
            self._thread.join(timeout)

    # --- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._busy and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                job = self._jobs.popleft() if self._jobs else None
                self._busy = False
                steppers = list(self._steppers)
            if job is not None:
                fut, fn = job
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # the caller re-raises it
                        fut.set_exception(exc)
            busy = False
            for stepper in steppers:
                try:
                    busy = stepper.step_once() or busy
                except Exception:  # a stepper fails its own answers; the thread carries on
                    log.exception("compute thread: a stepper raised")
            if busy:
                with self._cond:
                    self._busy = True


_compute: ComputeThread | None = None
_compute_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child has no compute thread (threads do not survive ``fork``): start afresh."""
    global _compute, _compute_lock
    _compute, _compute_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def compute() -> ComputeThread:
    """The process's compute thread, started on first use and stopped at process exit."""
    global _compute
    with _compute_lock:
        if _compute is None:
            _compute = ComputeThread()
            atexit.register(_compute.stop)
        return _compute


def call(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``compute().call(fn, *args, **kwargs)``: run ``fn`` on the compute thread."""
    return compute().call(fn, *args, **kwargs)


def on_compute_thread(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorator: every call of ``fn`` runs on the compute thread (see :func:`call`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        return compute().call(fn, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def torch_threads(n: int | None, *, restore: bool = True) -> Iterator[None]:
    """Run the block at ``n`` torch intra-op threads (``torch.set_num_threads``) on this thread.

    The compute thread is shared, so its count is whatever its last user set: each torch
    user (the embedder, the engine's steps, the CPU probe) runs at its own count. Sets the
    count only when it differs; with ``restore`` puts the previous count back after the block.
    The engine passes ``restore=False``: it runs every step and the next user sets its own,
    so flipping back and forth per step would only cost. ``n=None``: no change.
    """
    if n is None:
        yield
        return
    import torch

    prev = torch.get_num_threads()
    if prev != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if restore and prev != n:
            torch.set_num_threads(prev)
