"""Bridging the blocking answer pipeline to async streaming responses.

The pipeline's generator runs in a worker thread and hands events to the event
loop through an ``asyncio.Queue``. When the client disconnects, Starlette
cancels the response's async iterator; the ``finally`` here sets the cancel
event, so generation stops within a token and the queue slot is freed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse

if TYPE_CHECKING:
    from app.answering.state import AnswerEvent
    from app.answering.types import Answer

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


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (``data: ...`` and a blank line)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, default=str)}\n\n".encode()


async def final_summary(first: AnswerEvent, events: AsyncIterator[AnswerEvent]) -> Answer:
    """Drain an answer's events (``first`` and the rest) and return its final summary: what a
    non-streamed OpenAI response is built from. Every answer's stream ends with one."""
    final = first
    async for ev in events:
        final = ev
    assert final.summary is not None, "the pipeline ends every stream with a summary"
    return final.summary


async def openai_sse(first: AnswerEvent, events: AsyncIterator[AnswerEvent], *,
                     token: Callable[[AnswerEvent], bytes],
                     end: Callable[[Answer], list[bytes]]) -> AsyncIterator[bytes]:
    """An answer's events as OpenAI's server-sent stream: ``token(ev)`` for each token event,
    ``end(summary)`` for the final (or error) event, preceded by an error event when the answer
    failed, and ``data: [DONE]`` last. The admitted event is skipped (its figures go out as
    headers). An exception from the pipeline is sent as an error event (its ``code``, else
    ``internal_error``), never as a silent cut."""
    ev: AnswerEvent | None = first
    try:
        while ev is not None:
            if ev.kind == "token":
                yield token(ev)
            elif ev.kind != "admitted":
                s = ev.summary
                assert s is not None, "final and error events carry the summary"
                if ev.kind == "error":
                    err_obj = s.error.model_dump() if s.error is not None else None
                    yield sse({"error": {"code": "generation_failed", "message": str(err_obj)}})
                for chunk in end(s):
                    yield chunk
            ev = await anext(events, None)
    except Exception as exc:  # never a silent cut
        yield sse({"error": {"code": getattr(exc, "code", "internal_error"), "message": str(exc)}})
    yield b"data: [DONE]\n\n"


def event_stream(body: AsyncIterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    """A ``text/event-stream`` response of ``body`` that no proxy caches or buffers, with
    ``headers`` (the answer's plan headers) added."""
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
