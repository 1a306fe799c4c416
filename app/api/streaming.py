"""Bridging the blocking answer pipeline to async streaming responses.

The pipeline's generator runs in a worker thread and hands events to the event
loop through an ``asyncio.Queue``. When the client disconnects, Starlette
cancels the response's async iterator; the ``finally`` here sets the cancel
event, so generation stops within a token and the queue slot is freed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import Request

_DONE = object()


async def iterate_in_thread(make_iter: Callable[[], Iterator[Any]], cancel: threading.Event,
                            request: Request | None = None) -> AsyncIterator[Any]:
    """Run ``make_iter()`` in a thread and yield its items on the event loop.

    Exceptions raised by the iterator are re-raised here. ``cancel`` is set when
    the consumer stops early or the client disconnects.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def worker() -> None:
        try:
            for item in make_iter():
                loop.call_soon_threadsafe(queue.put_nowait, item)
                if cancel.is_set():
                    break
        except BaseException as exc:  # handed to the consumer
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)

    thread = threading.Thread(target=worker, name="ragbudget-answer", daemon=True)
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
