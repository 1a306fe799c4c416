"""Fakes that let the whole API run without a real model: a code-point tokenizer and a generator.

The embedder (:class:`tests.retrieval.fakes.HashingEmbedder`) and the latency
timer (:class:`tests.latency_model.conftest.FakeTimer`) are reused from their
own test packages; the retriever, store, planner, prompt builder and receipts
are the real ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from foundation.hashing import sha256_json
from generation.base import GenerationStats, GenParams, StreamBody, TokenEvent, TokenStream
from tests.latency_model.conftest import IDENTITY
from tests.latency_model.test_roofline import SMOLLM2


class CharTokenizer:
    """One token per Unicode code point (a lossless :class:`retrieval.tokens.TextTokenizer`)."""

    tokenizer_id = sha256_json({"name": "char-tokenizer", "version": 1})
    # Its "model's own" template: role names as plain text (no markers, so nothing to refuse).
    chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant: {% endif %}")

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        return [ord(c) for c in text], [(i, i + 1) for i in range(len(text))]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def wrapped(inner: TokenStream, events: Callable[[TokenStream], Iterator[TokenEvent]]) -> TokenStream:
    """A stream of what ``events(inner)`` yields (a test's change to ``inner``'s tokens: delays,
    faults), started at its first ``next()``, with ``inner``'s stats; ``inner`` is closed when it ends."""

    def body(outer: TokenStream) -> StreamBody:
        yield None
        try:
            yield from events(inner)
        finally:
            inner.close()
            outer.stats = inner.stats

    return TokenStream(body)


class EchoGenerator:
    """A :class:`generation.base.Generator` that streams a fixed reply, one character a token.

    ``gate`` (optional): every stream, at its first ``next()``, sets ``started`` and then waits
    on ``gate`` before its first token, so a test can hold the model busy. ``last_stats``: the
    stats of the latest stream that ended (what tests read when they hold no stream).
    """

    context_window = 8192  # as IDENTITY["context_window"], which keys the stored profile
    eos_token_ids = [0]

    def __init__(self, tokenizer: CharTokenizer, reply: str = "fake answer",
                 gate: threading.Event | None = None) -> None:
        self.identity: dict[str, Any] = dict(IDENTITY)
        self.tokenizer = tokenizer
        self.reply = reply
        self.gate = gate
        self.started = threading.Event()
        self.last_stats: GenerationStats | None = None
        self._cached: set[tuple[int, ...]] = set()

    def stream(self, prompt_ids: list[int], *, cached_prefix_ids: list[int] | None = None,
               params: GenParams, cancel: threading.Event | None = None,
               messages: list[dict[str, str]] | None = None,
               prefill_chunk: int | None = None) -> TokenStream:
        return TokenStream(lambda s: self._body(s, list(prompt_ids), cached_prefix_ids, params, cancel))

    def _body(self, stream: TokenStream, prompt_ids: list[int], cached_prefix_ids: list[int] | None,
              params: GenParams, cancel: threading.Event | None) -> StreamBody:
        yield None  # like a remote server: the answer starts at the first next()
        start = time.perf_counter()
        self.started.set()
        if self.gate is not None:
            self.gate.wait(30)
        prefix = tuple(cached_prefix_ids or ())
        cached = len(prefix) if prefix and prefix in self._cached else 0
        if prefix:
            self._cached.add(prefix)
        ids: list[int] = []
        first = last = None
        finish = "cancelled"  # unless the loop below ends on its own (closed early: a consumer stopped)
        try:
            for i, ch in enumerate(self.reply[: params.max_new_tokens]):
                if cancel is not None and cancel.is_set():
                    break
                t = time.perf_counter()
                first = first if first is not None else t
                last = t
                ids.append(ord(ch))
                yield TokenEvent(index=i, token_id=ord(ch), text=ch, t=t)
            else:
                finish = "length" if len(self.reply) > params.max_new_tokens else "stop"
        finally:  # like the real backends: this answer's stats on every path
            stream.stats = self.last_stats = GenerationStats(
                prompt_tokens=len(prompt_ids), cached_tokens=cached,
                computed_tokens=len(prompt_ids) - cached, output_token_ids=ids,
                finish_reason=finish,  # type: ignore[arg-type]
                prefill_ms=0.1, first_token_t=first, last_token_t=last, first_text_t=first, start_t=start,
                params=params)

    def prefix_cached(self, prefix_ids: list[int]) -> bool:
        return tuple(prefix_ids) in self._cached

    def warm_prefix(self, prefix_ids: list[int]) -> float:
        self._cached.add(tuple(prefix_ids))
        return 0.0

    def prefill_ms(self, prompt_tokens: int, cached_tokens: int) -> float:
        return 1.0 + 0.01 * (prompt_tokens - cached_tokens)

    def decode_step_ms(self, context_tokens: int) -> float:
        return 5.0

    def config_dict(self) -> dict[str, Any]:
        return dict(SMOLLM2)


class StepGenerator(EchoGenerator):
    """:class:`EchoGenerator` on a fixed schedule: a prefill of ``slow x`` the fake timer's true
    cost (``tests.latency_model.conftest.TRUE_PREFILL`` of the computed tokens), then one token
    per decode step of ``TRUE_DECODE`` at the prompt's length (sleeps, in ms).

    ``schedule_ms(prompt, cached, n)`` is the time the model is held for ``n`` tokens, which a
    test compares with the planner's predicted wait. ``gate`` holds it before the prefill.
    """

    def __init__(self, tokenizer: CharTokenizer, reply: str = "fake answer",
                 gate: threading.Event | None = None, slow: float = 1.0) -> None:
        super().__init__(tokenizer, reply, gate)
        self.slow = slow

    @staticmethod
    def true_prefill_ms(prompt_tokens: int, cached_tokens: int) -> float:
        from tests.latency_model.conftest import TRUE_PREFILL as k

        m = prompt_tokens - cached_tokens
        return k["a"] + k["b"] * m + k["g"] * m * (prompt_tokens + cached_tokens)

    @staticmethod
    def step_ms(context_tokens: int) -> float:
        from tests.latency_model.conftest import TRUE_DECODE as d

        return d["d"] + d["e"] * context_tokens

    def schedule_ms(self, prompt_tokens: int, cached_tokens: int, n: int) -> float:
        """The model's busy time for an answer of ``n`` tokens (prefill + n - 1 steps), ms."""
        return (self.slow * self.true_prefill_ms(prompt_tokens, cached_tokens)
                + max(n - 1, 0) * self.step_ms(prompt_tokens))

    def stream(self, prompt_ids: list[int], *, cached_prefix_ids: list[int] | None = None,
               params: GenParams, cancel: threading.Event | None = None,
               messages: list[dict[str, str]] | None = None,
               prefill_chunk: int | None = None) -> TokenStream:
        def events(inner: TokenStream) -> Iterator[TokenEvent]:
            prefix = tuple(cached_prefix_ids or ())
            cached = len(prefix) if prefix and prefix in self._cached else 0
            n = len(prompt_ids)
            delays = iter([self.slow * self.true_prefill_ms(n, cached)])

            def delay() -> float:
                return next(delays, self.step_ms(n))

            yield from _delayed(inner, delay)

        return wrapped(super().stream(prompt_ids, cached_prefix_ids=cached_prefix_ids, params=params,
                                      cancel=cancel, messages=messages), events)


def _delayed(events: Iterator[TokenEvent], delay_ms: Any) -> Iterator[TokenEvent]:
    """Sleep ``delay_ms()`` before each event and restamp it with the time it is released."""
    for ev in events:
        time.sleep(delay_ms() / 1000.0)
        yield TokenEvent(index=ev.index, token_id=ev.token_id, text=ev.text, t=time.perf_counter())
