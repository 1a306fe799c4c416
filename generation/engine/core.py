"""The engine core: continuous batching for the local generator, batch-invariant on CPU.

A step reads: admit waiting answers, ``plan = schedule(live)``
(:mod:`generation.engine.scheduler`), ``logits = runner.run(plan, live)``
(:mod:`generation.engine.runner`), then move positions, store scaffolds and emit tokens
(:meth:`Engine.step`).

Each engine step runs ONE forward pass over a packed row of tokens: the next
decode token of every running answer plus prefill chunks of answers still
reading their prompt, up to ``step_token_budget`` tokens (at least one chunk per
step, so a prefill always advances). Answers join at the next step after they
arrive (up to ``max_running`` at once) and leave the moment they finish or are
cancelled. This is the scheme of Orca / vLLM / Sarathi-Serve (chunked prefill
riding along with decode steps). Prefill chunks go in prefill order (a number each
answer takes when it is submitted, which the local generator does when ``stream()`` is
called, under the planner's admit lock; :func:`generation.engine.scheduler.schedule`), and
the first chunk that does not fit ends the step's prefill, so an answer never overtakes one
planned before it: the planner's replay of these steps
(``latency_model.step_model.batched_step_shapes``) holds whatever arrives later.

Batch invariance (an answer's tokens do not depend on its batch mates, its row
in the step, or when it arrived), established as follows:

* Linear layers, norms, embeddings and the LM head work row by row, but a GEMM's
  kernel (and so a row's bits) can depend on the row count M. On CPU torch (MKL
  sgemm, AVX2) a row's result was measured bit-identical across M and row
  offsets for M >= 4 with 1 thread, and for M in {4, 8} and M >= 12 with 2
  threads; so on CPU every step and every LM-head call is padded to
  :func:`generation.engine.scheduler.padded_rows` (a multiple of ``ROW_MULTIPLE``, at
  least ``MIN_ROWS``). On CUDA (cuBLAS picks kernels, split-K included, by shape)
  every step is padded to one fixed row count instead.
* Attention is computed per answer, over that answer's own KV buffer, with shapes
  that depend only on the answer itself (its chunk length and position).
* Prefill chunk boundaries are a pure function of the prompt: the scaffold
  prefix ``[0, P)`` in chunks of ``prefill_chunk`` from 0, the rest ``[P, N)``
  in chunks of ``prefill_chunk`` from ``P``. The prefix cache's blocks are these
  chunks (the scaffold one block, then each full chunk after it,
  :mod:`generation.engine.kv_cache`): a cached chain is exactly the KV those chunks
  produce, and an answer that loads it resumes at a chunk boundary of its own cold
  run, so a cache hit (at any block boundary) and a miss compute the same bits.
  ``prefill_chunk`` is recorded in the generator identity (receipts).

Failure isolation: after the forward, each answer's logits row is turned into its token on
its own (``Engine._choose``); an exception there (its sampling failed) ends that answer
alone with the error, while the other rows of the step, already computed, go on exactly as
they would without it. The same holds for an answer's admission (its KV buffer, its prefix
cache lookup) and for storing its blocks in the prefix cache. Only a failure of the
forward itself ends every answer in the step.

The attention over each answer's own KV buffer is
:mod:`generation.packed_attention`.

Warm work (``warm_turns > 0``, with the block cache): a follow-up turn's prompt starts with the
earlier turn's prompt ids, its output ids and the end of the turn (``app.answering.followup``),
but the output's K/V were computed by decode steps, one row at a time, which is not what a
prefill chunk of those positions computes, so they are never blocks. When an answer that carries
``tail_ids`` ends normally (an end-of-text token or ``max_new``; not cancelled, not failed), the
engine keeps a warm job: ``prompt + output + tail_ids`` cut down to its last whole block (the
block grid of :mod:`generation.engine.block_cache`, the answer's own scaffold boundary and
chunk). Only while no answer is running or waiting, the engine runs such a job one prefill chunk
per step, through the same admission (its longest cached chain loaded), scheduler, runner and
block stores as an answer, so each block it stores is bit for bit what a cold prefill of a
prompt starting with those ids computes there (chunk boundaries, positions, row padding and
kernels are the same). Newest job first; at most ``warm_turns`` jobs are kept (the oldest is
dropped). An answer that arrives meanwhile, or a job queued on the compute thread, stops the
warm chunk in progress at its next layer (``StepContext.abort``; the chunk's partial K/V are
dropped with the job's buffer, nothing partial is stored) and the job is set aside: its stored
blocks stay, and it resumes from them later. So an arrival waits one layer of one chunk, not a
chunk (a 256-token chunk is about 0.6 s on a 2-core CPU). Its stores
go through :meth:`BlockPrefixCache.insert` like any answer's: within the budget, least recently
used unpinned blocks evicted first, pinned blocks never. :attr:`Engine.warm_tokens` and the
cache's ``warm_tokens`` count the tokens it computed.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from foundation.compute import compute
from generation.engine.kv_cache import BlockPrefixCache, KVCache, Pin
from generation.engine.messages import (
    Admitted,
    BatchSnapshot,
    Decoding,
    EndReason,
    Finished,
    Prefilling,
    StepRecord,
    Token,
)
from generation.engine.request import Request
from generation.engine.runner import ModelRunner, StepAborted
from generation.engine.scheduler import StepPlan, admissions, schedule
from generation.sampling import mask_ids

#: Engine steps the step log keeps (:meth:`Engine.recent_steps`): a few seconds of steps.
STEP_LOG = 256


def _whole_blocks_end(n: int, prefix_len: int, chunk: int) -> int:
    """End of the last whole block of ``n`` ids whose blocks start at ``prefix_len`` in steps of
    ``chunk`` (the block grid of :mod:`generation.engine.block_cache`)."""
    return prefix_len + (n - prefix_len) // chunk * chunk


def _no_token(logits: Any) -> int:
    """A warm job's sampler: it never chooses a token (``Engine._update`` skips it)."""
    raise AssertionError("a warm job chooses no token")


def _order(req: Request) -> int:
    """``req``'s prefill order (-1 before it has one: an answer run alone by ``run_alone``)."""
    return req.order if req.order is not None else -1


def _close_engine(ref: weakref.ReferenceType[Engine]) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


class Engine:
    """The step loop: admits, packs, runs one forward per step, routes tokens.

    Steps run on the process's compute thread (``foundation.compute``), which calls
    :meth:`step_once` between jobs, so answers run on the same OpenMP team as the
    calibration timers; :meth:`run_alone` and :meth:`step` must be called on that thread too.

    Args:
        model: a transformers causal LM whose attention implementation is
            :data:`generation.packed_attention.ATTN_NAME`.
        device: torch device string.
        lock: the model lock (held for each step; calibration timers hold it too).
        prefix_lookup: ``prefix_ids -> (kv dict, last_logits) | None``: a private scaffold
            store, used only without ``prefix_cache`` (the calibration timers' engines).
        prefix_store: ``(prefix_ids, kv dict, last_logits) -> None`` (the same store).
        prefix_known: ``prefix_ids -> bool``, whether that store holds them now (read by
            :meth:`batch_snapshot` for answers not admitted yet); None: not known.
        max_running: answers in the running batch at most.
        step_token_budget: tokens per step at most (decode tokens + prefill chunks), except
            that one prefill chunk always fits.
        fixed_rows: pad every step and LM-head call to exactly this many rows (CUDA);
            None pads by :func:`generation.engine.scheduler.padded_rows` (CPU).
        threads: torch intra-op threads every forward runs at, set on the compute thread when
            it differs (another model of the process may have set its own); None leaves the
            thread's count as it is.
        prefix_cache: the shared prefix cache over token blocks
            (:class:`generation.engine.kv_cache.BlockPrefixCache`): each answer loads the
            longest cached chain of its blocks at admission and stores every block it computes.
        pad_rows: False runs steps unpadded (:class:`generation.engine.runner.ModelRunner`'s
            ``pad``; the int8 precision).
        warm_turns: finished turns whose tails are kept to prefill while idle (module docstring,
            "Warm work"); 0 turns warm work off. Needs ``prefix_cache``.
    """

    def __init__(self, model: Any, device: str, lock: threading.Lock,
                 prefix_lookup: Callable[[list[int]], tuple[Any, Any] | None],
                 prefix_store: Callable[[list[int], Any, Any], None],
                 max_running: int, step_token_budget: int, fixed_rows: int | None = None,
                 prefix_known: Callable[[list[int]], bool] | None = None,
                 threads: int | None = None, prefix_cache: BlockPrefixCache | None = None,
                 pad_rows: bool = True, warm_turns: int = 0) -> None:
        self.lock = lock
        self.runner = ModelRunner(model, device, fixed_rows, threads, pad_rows)
        self.kv_cache = KVCache(prefix_lookup, prefix_store, prefix_known, prefix_cache)
        self.max_running, self.step_token_budget = max_running, step_token_budget
        self._state = threading.RLock()  # guards the queues; re-entered by _cancel_all
        self._orders = itertools.count()  # prefill order: taken at submit
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._attached = False
        self._drained = threading.Event()
        self.steps = 0
        self.peak_rows_answers = 0  # most answers seen in one step (tests, metrics)
        self._log: deque[StepRecord] = deque(maxlen=STEP_LOG)
        self._log_lock = threading.Lock()
        self._stop = False
        self.warm_turns = max(0, int(warm_turns)) if prefix_cache is not None else 0
        self._warm: deque[tuple[list[int], int, int]] = deque(maxlen=max(1, self.warm_turns))
        self._warm_seq: Request | None = None  # the warm job in progress (compute thread only)
        self._warm_taking = False  # a warm job is being admitted (taken from the queue)
        self.warm_steps = 0  # steps that ran warm work
        self.warm_tokens = 0  # tokens they computed
        self.warm_set_aside = 0  # warm jobs set aside for an answer that arrived
        self.warm_log: deque[tuple[float, float]] = deque(maxlen=STEP_LOG)  # (start, end) per warm step
        # Cancel what is left before the interpreter finalises: the compute thread must not be
        # inside torch at exit, which aborts the process ("terminate called without an active
        # exception").
        atexit.register(_close_engine, weakref.ref(self))

    def close(self) -> None:
        """Stop at the next step boundary; answers still running or waiting end as cancelled.
        Waits up to 5 s for the compute thread to reach that boundary."""
        with self._state:
            self._stop = True
            attached = self._attached
        if not attached:
            self._cancel_all()
            return
        ct = compute()
        if ct.is_current():
            self.step_once()
            return
        ct.wake()
        self._drained.wait(timeout=5.0)

    # --- public ------------------------------------------------------------------------
    def submit(self, seq: Request) -> None:
        """Queue ``seq``; it joins the running batch at the next step with room. Without an
        ``order`` it takes the next one now: its chunks go before those of every answer
        submitted later. A pin waiting for its prompt (:meth:`pin`) becomes its own, released
        once its admission loaded the chain, or when it ends before that."""
        if seq.pin is None:  # the chain its plan pinned (Engine.pin), released at admission
            seq.pin = self.kv_cache.take_pin(seq.prompt, seq.prefix_len, seq.chunk)
        with self._state:
            if seq.order is None:
                seq.order = next(self._orders)
            self._waiting.append(seq)
            attach = not self._attached
            self._attached = True
        if attach:
            compute().attach(self)
        else:
            compute().wake()

    def wake(self) -> None:
        """Wake the step loop (after a cancel event was set, so it drops that answer now)."""
        if self._attached:
            compute().wake()

    def running_count(self) -> int:
        """Answers admitted to the engine now (prefilling or decoding)."""
        with self._state:
            return len(self._running)

    def batch_snapshot(self) -> BatchSnapshot:
        """What a new answer would share steps with, now: each running answer that is decoding
        (:class:`Decoding`: tokens in its KV; steps until it reaches ``max_new``, fewer if it
        stops at an end-of-text token), and each answer admitted or waiting that is still
        prefilling (:class:`Prefilling`: prompt tokens left, next position, max_new, order), in
        prefill order (:func:`generation.engine.scheduler.schedule`). An answer not admitted
        yet starts after the longest chain of its blocks the prefix cache holds now
        (:meth:`cached_tokens`), else from position 0. Read by ``app.answering.bands`` for
        ``latency_model.step_model.BatchedBand``."""
        with self._state:
            seqs = [s for s in [*self._running, *self._waiting] if not s.done]
            decoding = tuple(Decoding(s.pos, max(s.max_new - s.produced, 0))
                             for s in seqs if not s.in_prefill())
            prefilling = [(s, len(s.prompt), s.pos, s.max_new, s.kv is None, _order(s))
                          for s in seqs if s.in_prefill()]
        out: list[Prefilling] = []
        for seq, n, pos, max_new, waiting, order in sorted(prefilling, key=lambda e: e[5]):
            # The cache has its own lock: asked outside _state.
            if waiting and pos == 0:
                pos = self.kv_cache.cached_tokens(seq.prompt, seq.prefix_len, seq.chunk)
            out.append(Prefilling(n - pos, pos, max_new, order))
        return BatchSnapshot(decoding, tuple(out))

    def cached_tokens(self, prompt: list[int], prefix_len: int, chunk: int) -> int:
        """Tokens of ``prompt`` (scaffold ``prompt[:prefix_len]``, prefilled in chunks of
        ``chunk``) that an answer admitted now would take from the prefix cache: the end of
        the longest cached chain of its blocks, 0 when none (a whole prompt only when the
        next-token logits after it are cached too). Nothing is pinned: an eviction before
        the answer is admitted makes it compute more (:meth:`pin` holds them)."""
        return self.kv_cache.cached_tokens(prompt, prefix_len, chunk)

    def pin(self, prompt: list[int], prefix_len: int, chunk: int) -> Pin | None:
        """Pin the cached chain of ``prompt`` (as :meth:`cached_tokens`) until the answer that
        runs it is admitted, for a planner that priced it: the answer submitted with this prompt
        takes the pin (:meth:`submit`) and its admission releases it; ``Pin.release`` (idempotent)
        frees it on every other path (the answer never reached the engine). The pin's
        ``cached_tokens`` is what that admission will load at least (fewer than the cache holds
        when pins would pass their share of the cache's budget). None without a block cache."""
        return self.kv_cache.pin(prompt, prefix_len, chunk)

    def recent_steps(self) -> list[StepRecord]:
        """The last :data:`STEP_LOG` timed steps, oldest first: what the machine is doing now
        (``app.answering.bands`` reads the machine's speed from them against the step model)."""
        with self._log_lock:
            return list(self._log)

    def run_alone(self, seq: Request, *, decode_steps: int = 0) -> None:
        """Drive ``seq`` synchronously (caller holds the model lock) until its first token, plus
        ``decode_steps`` decode steps: the calibration timers and prefix warming use this."""
        self._admit(seq)
        if seq.first_logits is not None:  # cached whole: its first token from the cache, no step
            logits, seq.first_logits = seq.first_logits, None
            self._choose(seq, logits)
        while not seq.done and (seq.in_prefill() or seq.next_tok is None):
            self.step([seq])
        for _ in range(decode_steps):
            if seq.done:
                break
            self.step([seq])

    # --- the loop ----------------------------------------------------------------------
    def step_once(self) -> bool:
        """One step of the running batch; the compute thread calls it between jobs
        (``foundation.compute``). Admits waiting answers up to ``max_running``, drops those
        whose consumer left, runs one forward; with no answer running or waiting, one step of
        warm work instead (module docstring). Returns True while answers or warm work remain."""
        with self._state:
            if self._stop:  # closed (or process exit): every answer still here ends as cancelled
                self._cancel_all()
                return False
            for seq in [s for s in self._waiting if self._gone(s)]:  # left while waiting
                self._waiting.remove(seq)
                self._finish(seq, "cancelled")
            for _ in range(admissions(len(self._running), len(self._waiting), self.max_running)):
                self._running.append(self._waiting.popleft())
            batch = list(self._running)
            if batch and self._warm_seq is not None:  # an answer arrived: warm work yields
                self._set_warm_aside()
            warm = not batch and not self._waiting and self._warm_pending()
        if warm:
            self._warm_step()
        for seq in batch:
            if seq.admitted_t is None and not self._gone(seq):
                try:
                    self._admit(seq)
                except Exception as exc:  # this answer could not be admitted: it alone ends
                    self._finish(seq, "error", exc)
        try:
            live = [s for s in batch if not self._gone(s) and not s.done]
            if live:
                with self.lock:
                    self.step(live)
        except Exception as exc:  # the model failed: every answer in the step ends with it
            for seq in batch:
                if not seq.done:
                    self._finish(seq, "error", exc)
        with self._state:
            for seq in batch:
                if self._gone(seq) and not seq.done:
                    self._finish(seq, "cancelled")
            self._running = [s for s in self._running if not s.done]
            return bool(self._waiting or self._running or self._warm_pending())

    def _cancel_all(self) -> None:
        with self._state:
            for seq in [*self._waiting, *self._running]:
                if not seq.done:
                    self._finish(seq, "cancelled")
            self._waiting.clear()
            self._running = []
            self._warm.clear()
            self._warm_seq = None
            attached, self._attached = self._attached, False
        if attached:
            compute().detach(self)
        self._drained.set()

    @staticmethod
    def _gone(seq: Request) -> bool:
        return seq.closed or (seq.cancel is not None and seq.cancel.is_set())

    def _finish(self, seq: Request, reason: EndReason, exc: BaseException | None = None) -> None:
        seq.done = True
        seq.kv = None
        if seq.pin is not None:  # ended before its admission (cancelled, failed): no leak
            seq.pin.release()
        if reason in ("stop", "length") and seq.tail_ids is not None and not self._gone(seq):
            self._queue_warm(seq)  # before its reader sees the end: warm_pending() says so then
        seq.out.put(Finished(reason, exc))

    def _admit(self, seq: Request) -> None:
        admitted_t = time.perf_counter()
        try:
            got = self.kv_cache.admit(seq.prompt, seq.prefix_len, seq.max_new, seq.chunk,
                                      count=not seq.warm)
        finally:  # the chain is loaded (or the admission failed): the pin has done its work
            if seq.pin is not None:
                seq.pin.release()
        with self._state:  # batch_snapshot sees the answer before admission or after, never half-way
            seq.admitted_t, seq.kv = admitted_t, got.kv
            seq.pos, seq.cached_tokens = got.cached_tokens, got.cached_tokens
            seq.blocks, seq.cached_blocks = got.plan, got.cached_blocks
            if got.first_logits is not None:
                seq.first_logits = got.first_logits
        seq.out.put(Admitted(admitted_t, got.cached_tokens))

    def step(self, live: list[Request], abort: Callable[[], bool] | None = None) -> None:
        """One step of exactly the admitted answers ``live`` on the caller's thread (the compute
        thread, model lock held): ``plan = schedule(live)``, ``logits = runner.run(plan, live)``,
        then :meth:`_update` (positions, scaffolds stored, tokens emitted); logged in
        :meth:`recent_steps`. A prompt the prefix cache held whole takes its first token from
        the cache's logits first. Raises whatever the forward raises (every answer in
        the step ends with it: :meth:`step_once`). ``abort``: see
        :meth:`generation.engine.runner.ModelRunner.run` (warm work only)."""
        t0 = time.perf_counter()
        for seq in live:  # a prompt cached whole: first token from the cached logits
            if seq.first_logits is not None:
                logits, seq.first_logits = seq.first_logits, None
                self._choose(seq, logits)
        live = [s for s in live if not s.done]
        plan = schedule(live, self.step_token_budget)
        if not plan.chunks:
            return
        logits = self.runner.run(plan, live) if abort is None else self.runner.run(plan, live, abort)
        self.steps += 1
        self.peak_rows_answers = max(self.peak_rows_answers, len(plan.chunks))
        self._update(plan, live, logits)
        t1 = time.perf_counter()
        record = StepRecord(t1, plan.segments, plan.logit_rows, (t1 - t0) * 1000.0)
        with self._log_lock:
            self._log.append(record)

    def _update(self, plan: StepPlan, live: list[Request], logits: Any) -> None:
        """After the forward: each answer's position moves past its chunk; a chunk that
        completes one of its blocks not loaded from the prefix cache stores it there (with the
        chunk's logits row when the step computed one); an answer whose prompt is done gets its
        next token from its own logits row (``logits``: ``(plan.logit_rows, vocab)``)."""
        row = 0
        for item in plan.chunks:
            seq = live[item.index]
            seq.pos = item.start + item.tokens
            lg = None
            if item.needs_logits:
                lg = logits[row]  # (vocab,)
                row += 1
            if not item.decode:
                try:
                    self._store(seq, lg)
                except Exception as exc:  # storing this answer's KV failed: it alone ends
                    self._finish(seq, "error", exc)
                    continue
            if lg is None or seq.in_prefill() or seq.warm:
                continue
            self._choose(seq, lg)

    def _store(self, seq: Request, lg: Any) -> None:
        """Store what ``seq``'s chunk just completed: the block ending at ``seq.pos`` (block
        cache), or its uncached scaffold (private store)."""
        assert seq.kv is not None
        if seq.blocks is not None:
            index = seq.blocks.ending_at(seq.pos)
            if index is not None and index >= seq.cached_blocks:
                self.kv_cache.store_block(seq.kv, seq.blocks, index, lg)
        elif seq.pos == seq.prefix_len and seq.cached_tokens == 0 and seq.prefix_len and lg is not None:
            self.kv_cache.store_prefix(seq.prompt, seq.prefix_len, seq.kv, lg)

    def _choose(self, seq: Request, logits: Any) -> None:
        """Pick and route ``seq``'s next token from its own logits row ``(vocab,)``. Whatever
        goes wrong here (its sampling raises, non-finite probabilities) ends ``seq`` alone with
        that error: the other rows of the step are already computed and go on untouched."""
        try:
            if seq.produced < seq.min_new and seq.eos:
                logits = mask_ids(logits, seq.eos)
            tok = seq.select(logits)
        except Exception as exc:  # this answer's sampling failed: it ends, its batch mates do not
            self._finish(seq, "error", exc)
            return
        self._emit(seq, tok, time.perf_counter())

    def _emit(self, seq: Request, tok: int, t: float) -> None:
        if tok in seq.eos and not seq.ignore_eos:
            self._finish(seq, "stop")
            return
        seq.out.put(Token(tok, t))
        seq.output.append(tok)
        seq.produced += 1
        seq.next_tok = tok
        if seq.produced >= seq.max_new:
            self._finish(seq, "length")

    # --- warm work (module docstring, "Warm work"; compute thread only) -----------------
    def _warm_pending(self) -> bool:
        """True while a warm job is in progress or kept (``_state`` held or not needed)."""
        return self._warm_seq is not None or self._warm_taking or bool(self.warm_turns and self._warm)

    def warm_pending(self) -> bool:
        """True while warm work is queued or in progress (module docstring, "Warm work")."""
        with self._state:
            return self._warm_pending()

    def warm_queue(self) -> list[int]:
        """Tokens of each queued warm job, newest (next to run) first; the job in progress, set
        aside or not, is not listed while it runs."""
        with self._state:
            return [len(ids) for ids, _, _ in reversed(self._warm)]

    def queue_warm(self, ids: list[int], prefix_len: int, chunk: int) -> bool:
        """Queue a warm job over ``ids`` (scaffold ``ids[:prefix_len]``, prefilled in chunks of
        ``chunk``) cut down to its last whole block: its blocks are computed while the engine is
        idle and stored in the prefix cache (module docstring). The oldest job drops out when
        ``warm_turns`` are queued. Returns False (nothing queued) when warm work is off or the
        cut leaves no block.

        Raises:
            ValueError: ``chunk < 1`` or ``prefix_len`` outside ``[0, len(ids)]``.
        """
        if chunk < 1 or not 0 <= prefix_len <= len(ids):
            raise ValueError(f"bad warm job: chunk={chunk} prefix_len={prefix_len} n={len(ids)}")
        end = _whole_blocks_end(len(ids), prefix_len, chunk)
        if not self.warm_turns or end <= 0:
            return False
        with self._state:
            self._warm.append((list(ids[:end]), prefix_len, chunk))  # the oldest drops out
            attach = not self._attached and not self._stop
            self._attached = self._attached or attach
        if attach:
            compute().attach(self)
        elif not compute().is_current():
            compute().wake()
        return True

    def _queue_warm(self, seq: Request) -> None:
        """Keep a warm job for the answer ``seq`` that just ended normally: ``prompt + output +
        tail_ids`` (the tail's first id left out when the output already ends with it, as
        ``PromptBuilder.continuation_ids`` does) cut down to its last whole block; nothing when
        that adds no block past the prompt's own."""
        if not self.warm_turns or seq.blocks is None or seq.tail_ids is None:
            return
        tail = list(seq.tail_ids)
        if seq.output and tail and seq.output[-1] == tail[0]:
            tail = tail[1:]
        ids = [*seq.prompt, *seq.output, *tail]
        end = _whole_blocks_end(len(ids), seq.prefix_len, seq.chunk)
        if end > (seq.blocks.ends[-1] if len(seq.blocks) else 0):
            self.queue_warm(ids, seq.prefix_len, seq.chunk)

    def _warm_yields(self) -> bool:
        """Asked at every layer of a warm step: True once an answer waits or a compute job is
        queued (the step then stops between layers and the job is set aside)."""
        return bool(self._waiting) or compute().pending() > 0

    def _set_warm_aside(self) -> None:
        """An answer arrived: the warm job in progress goes back to the queue's newest end, its
        buffer freed (the blocks it stored stay cached; it resumes from them). ``_state`` held."""
        seq, self._warm_seq = self._warm_seq, None
        if seq is not None and not seq.done:
            self._warm.append((seq.prompt, seq.prefix_len, seq.chunk))
            self.warm_set_aside += 1

    def _warm_step(self) -> None:
        """One prefill chunk of the newest warm job (taken and admitted first when none is in
        progress): one engine step of that job alone, its full blocks stored as an answer's
        are. A job whose last block is cached already is dropped without a step; a failure
        drops the job alone."""
        seq = self._warm_seq
        cache = self.kv_cache.blocks
        if seq is None:
            with self._state:
                if not self._warm or cache is None:
                    return
                ids, prefix_len, chunk = self._warm.pop()
                self._warm_taking = True  # neither queued nor in progress: warm_pending() holds
            try:
                seq = Request(prompt=ids, prefix_len=prefix_len, max_new=1, chunk=chunk,
                              select=_no_token, eos=frozenset(), warm=True)
                if cache.has(cache.plan(ids, prefix_len, chunk).keys[-1]):
                    return  # held whole already (a follow-up, or an earlier warm job, stored it)
                self._admit(seq)
                if seq.in_prefill():
                    self._warm_seq = seq
            except Exception:  # a failed lookup drops this job alone
                return
            finally:
                self._warm_taking = False
            if self._warm_seq is None:
                return
        before, t0 = seq.pos, time.perf_counter()
        try:
            with self.lock:
                self.step([seq], abort=self._warm_yields)
        except StepAborted:  # an answer or a job arrived mid-chunk: the chunk is dropped
            with self._state:
                self._set_warm_aside()
            self.warm_log.append((t0, time.perf_counter()))
            return
        except Exception:  # the model failed on warm work: drop the job, answers are not touched
            seq.done = True
        self.warm_log.append((t0, time.perf_counter()))
        self.warm_steps += 1
        self.warm_tokens += seq.pos - before
        if cache is not None:
            cache.count_warm(seq.pos - before)
        plan = seq.blocks
        index = plan.ending_at(seq.pos) if plan is not None else None
        if plan is not None and index is not None and cache is not None and not cache.has(plan.keys[index]):
            seq.done = True  # the cache kept no room for it (pins, budget): computing on stores nothing
        if seq.done or not seq.in_prefill():
            seq.kv = None
            self._warm_seq = None
