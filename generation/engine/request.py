"""One answer inside the engine: its prompt, how far it got, its KV buffer and its event queue."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from generation.engine.kv_cache import BlockPlan, Pin, SeqKV
from generation.engine.messages import EngineEvent
from generation.engine.scheduler import next_chunk


@dataclass
class Request:
    """One answer inside the engine.

    ``prompt[:prefix_len]`` is the scaffold, the first block of its chain in the prefix cache
    (``generation.engine.kv_cache``); ``blocks`` are its blocks (set at admission, with the
    block cache) and ``cached_blocks`` how many of them were loaded from the cache. Events go
    to ``out`` (:mod:`generation.engine.messages`): ``Admitted`` when it joins the batch, a
    ``Token`` per token, a final ``Finished``.

    ``select`` turns the answer's logits row ``(vocab,)`` into its next token id; while fewer
    than ``min_new`` tokens were produced, the ``eos`` ids are masked out of that row first
    (``-inf``). ``ignore_eos``: an ``eos`` token is output like any other and the answer
    goes on to ``max_new`` (vLLM's ``min_tokens`` and ``ignore_eos``).

    ``tail_ids``: the ids a follow-up turn places right after this answer's output (the end of
    the turn and the next user header; ``()`` when not known): when set, an answer that ends
    normally (an end-of-text token or ``max_new``) leaves the engine a warm job over
    ``prompt + output + tail_ids`` (``generation.engine.core``, "Warm work"); None: none.
    ``output`` collects the ids it emitted. ``warm``: this request is such a warm job (it
    chooses no token; its blocks go to the prefix cache).
    """

    prompt: list[int]
    prefix_len: int
    max_new: int
    chunk: int
    select: Callable[[Any], int]
    eos: frozenset[int]
    cancel: threading.Event | None = None
    min_new: int = 0
    ignore_eos: bool = False
    out: queue.SimpleQueue[EngineEvent] = field(default_factory=queue.SimpleQueue)
    kv: SeqKV | None = None
    pos: int = 0
    next_tok: int | None = None
    produced: int = 0
    done: bool = False
    closed: bool = False  # the consumer is gone
    cached_tokens: int = 0
    admitted_t: float | None = None
    first_logits: Any = None  # set when a prefix-only prompt takes the cache's logits
    order: int | None = None  # prefill order (taken at Engine.submit)
    blocks: BlockPlan | None = None  # its prefix-cache blocks (set at admission)
    cached_blocks: int = 0  # of which loaded from the cache
    pin: Pin | None = None  # its planned chain, held until admission (taken at Engine.submit)
    tail_ids: tuple[int, ...] | None = None  # what a follow-up places after the output (warm job)
    output: list[int] = field(default_factory=list)  # ids emitted so far
    warm: bool = False  # a warm job: prefill only, its blocks stored, no token chosen

    @property
    def prompt_len(self) -> int:
        """Tokens in the prompt (``len(prompt)``)."""
        return len(self.prompt)

    @property
    def decode_ready(self) -> bool:
        """True when the answer's next step is a decode step: its prompt is prefilled and its
        latest token is known (``next_tok``)."""
        return not self.in_prefill() and self.next_tok is not None

    def in_prefill(self) -> bool:
        """True while prompt tokens remain to be prefilled (``pos`` < prompt length)."""
        return self.pos < len(self.prompt)

    def next_chunk(self) -> tuple[int, int]:
        """``[start, end)`` of the next prefill chunk: a pure function of prompt, prefix, chunk
        (:func:`generation.engine.scheduler.next_chunk`)."""
        return next_chunk(self.pos, len(self.prompt), self.prefix_len, self.chunk)

    def gone(self) -> bool:
        """True once the answer's consumer left (``closed``) or its cancel event is set."""
        return self.closed or (self.cancel is not None and self.cancel.is_set())
