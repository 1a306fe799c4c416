"""Generating an answer: hand its prompt to its engine and read the tokens it streams.

:func:`start` hands the prompt to the generator under the engine's admit lock (the local engine
queues the answer at once, in grant order); :func:`granted_t` says when the model was granted
(where the measured prefill starts); :func:`read_tokens` reads the stream into the answer's
:class:`app.answering.state.InFlight`, cutting stop strings on the decoded text
(:mod:`generation.stopping`, the same way replay cuts them) and yielding the released text.
The waiting, the retry on another engine and the receipt are the pipeline's
(:mod:`app.answering.pipeline`, :mod:`app.answering.admit`, :mod:`app.answering.finish`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from app.answering.genqueue import Ticket
from app.answering.state import AnswerEvent, InFlight, Prepared
from generation.base import Generator, GenParams, TokenStream
from generation.stopping import StopMatcher


def start(gen: Generator, p: Prepared, params: GenParams,
          cancel: threading.Event) -> tuple[TokenStream | None, Exception | None]:
    """Hand ``p``'s prompt to ``gen``: ``(its stream, None)``, or ``(None, the error)`` when
    ``gen.stream`` refuses it (a bad prompt or parameters), which the caller raises where
    the answer's tokens are read, so it ends as a failed answer with its receipt. Called
    under the engine's admit lock: the local engine queues the answer now, in grant order."""
    try:
        stream = gen.stream(p.prompt.ids, cached_prefix_ids=p.prompt.scaffold_ids, params=params,
                            cancel=cancel, messages=p.prompt.messages or None)
    except Exception as exc:
        return None, exc
    return stream, None


def granted_t(stream: TokenStream | None) -> float:
    """When the model was granted to the answer of ``stream``, ``perf_counter`` seconds (where
    its measured prefill starts): when its engine took it (``accepted_t``: the local engine,
    at ``stream()``), else now, just before its first ``next()`` (a remote server)."""
    if stream is not None and stream.accepted_t is not None:
        return stream.accepted_t
    return time.perf_counter()


def read_tokens(stream: TokenStream, state: InFlight, ticket: Ticket, stopper: StopMatcher,
                cancel: threading.Event) -> Iterator[AnswerEvent]:
    """Read ``stream`` into ``state`` and yield a ``token`` event per piece of text the stop
    matcher releases; return at the end of the stream, at a stop string (``state.stop``) or
    once ``cancel`` is set. ``ticket.produced`` follows the tokens read (the queue's predicted
    wait). An error of the stream propagates to the caller."""
    for ev in stream:
        state.n += 1
        ticket.produced = state.n
        state.last_t = ev.t
        state.ids_per_event = state.ids_per_event and ev.token_id >= 0
        if state.first_t is None and ev.text:
            state.first_t = ev.t
        released, stopped = stopper.feed(ev.text)
        if released:
            state.text.append(released)
            yield AnswerEvent("token", text=released, tokens=state.n)
        if stopped:
            state.stop = stopper.matched
            return
        if cancel.is_set():
            return


def flush(stopper: StopMatcher, state: InFlight) -> Iterator[AnswerEvent]:
    """The text the stop matcher still holds at the end of the stream (a possible start of a
    stop string that never completed), as one last ``token`` event."""
    held = stopper.flush()
    if held:
        state.text.append(held)
        yield AnswerEvent("token", text=held, tokens=state.n)
