"""Bridging the blocking answer pipeline to async streaming responses.

The pipeline's generator runs in a worker thread and hands events to the event
loop through an ``asyncio.Queue``. When the client disconnects, Starlette
cancels the response's async iterator; the ``finally`` here sets the cancel
event, so generation stops within a token and the queue slot is freed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import Request

_DONE = object()
# Answers running in worker threads, with their cancel events: finish_answers() cancels and waits
# for them when the server stops, so each one writes its receipt before the process exits.
_LIVE: dict[threading.Thread, threading.Event] = {}
_LIVE_LOCK = threading.Lock()


def finish_answers(timeout_s: float) -> int:
    """Cancel every answer still running in a worker thread and wait for them to end.

    Called once the server has stopped (``app.cli.serve_cmds.run_server``): a cancelled
    answer ends within one token and appends its ``cancelled`` receipt. Waits at most
    ``timeout_s`` seconds in all. Returns how many answers were still running after the wait.
    """
    with _LIVE_LOCK:
        live = list(_LIVE.items())
    for _thread, cancel in live:
        cancel.set()
    deadline = time.monotonic() + max(0.0, timeout_s)
    for thread, _cancel in live:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sum(t.is_alive() for t, _ in live)


async def iterate_in_thread(make_iter: Callable[[], Iterator[Any]], cancel: threading.Event,
                            request: Request | None = None) -> AsyncIterator[Any]:
    """Run ``make_iter()`` in a thread and yield its items on the event loop.

    Exceptions raised by the iterator are re-raised here. ``cancel`` is set when
    the consumer stops early or the client disconnects.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed (server stopped): nobody reads any more
            cancel.set()

    def worker() -> None:
        try:
            for item in make_iter():
                put(item)
                if cancel.is_set():
                    break
        except BaseException as exc:  # handed to the consumer
            put(exc)
        finally:
            put(_DONE)
            with _LIVE_LOCK:
                _LIVE.pop(threading.current_thread(), None)

    thread = threading.Thread(target=worker, name="ragbudget-answer", daemon=True)
    with _LIVE_LOCK:
        _LIVE[thread] = cancel
    thread.start()
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=0.25)
            except TimeoutError:
                if request is not None and await request.is_disconnected():
                    cancel.set()
                continue
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancel.set()
        # Let the worker finish its receipt without blocking the loop.
        await asyncio.to_thread(thread.join, 30.0)
