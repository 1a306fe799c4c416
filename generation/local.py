"""The local backend: a Hugging Face transformers causal LM behind a continuous-batching engine.

Answers run through the engine, :mod:`generation.engine` (not ``model.generate``): one
forward per engine step over the decode tokens of every running answer plus
prefill chunks of new ones, each answer with its own KV buffer, so several
answers share the model at once; the scaffold's KV comes from the prefix cache,
cancellation is checked between tokens, and every token carries its own
``time.perf_counter()`` stamp. An answer's tokens do not depend on what else
runs with it (:mod:`generation.engine.core` and docs/receipts.md say how and where). The
calibration timers time steps through the engine's public API: the scheduler's
:func:`~generation.engine.scheduler.schedule` and the runner's
:meth:`~generation.engine.runner.ModelRunner.run`, or a whole answer alone
(:meth:`~generation.engine.core.Engine.run_alone`).
"""

from __future__ import annotations

import platform
import queue
import random
import threading
import time
from pathlib import Path
from typing import Any

from foundation.compute import call as compute_call
from foundation.compute import on_compute_thread, torch_threads
from foundation.errors import BackendError, InvalidConfig, InvalidInput, RagBudgetError, TooLarge
from generation.base import (
    GenerationStats,
    GenParams,
    IncrementalDetokenizer,
    StreamBody,
    TokenEvent,
    TokenStream,
)
from generation.engine.core import Engine
from generation.engine.kv_cache import DEFAULT_PREFIX_CACHE_MIB, BlockPrefixCache, SeqKV
from generation.engine.messages import Admitted, Finished, StepRecord
from generation.engine.request import Request
from generation.engine.scheduler import MIN_ROWS, ROW_MULTIPLE, schedule
from generation.packed_attention import ATTN_NAME, register_packed_attention
from generation.precision import (
    DEFAULT_TILE_ROWS,
    apply_precision,
    check_int8_kernel,
    check_precision,
    pads_rows,
    precision_label,
)
from generation.sampling import select_token
from retrieval.tokens import HFTextTokenizer, TextTokenizer

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def resolve_device_dtype(device: str = "auto", dtype: str = "auto") -> tuple[str, str]:
    """Pick ``(device, dtype)``: CUDA in bfloat16 when available, else CPU in float32.

    Raises:
        InvalidConfig: ``device="cuda"`` without a CUDA device, or an unknown dtype.
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidConfig("generator_device=cuda but torch sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise InvalidConfig(f"unknown generator device {device!r}")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if dtype not in _DTYPES:
        raise InvalidConfig(f"unknown generator dtype {dtype!r}")
    return device, dtype


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return str(torch.cuda.get_device_name(0))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


class LocalGenerator:
    """:class:`generation.base.Generator` over a local HF model directory.

    Args:
        model_dir: directory with ``config.json`` and weights (safetensors).
        tokenizer: the model's tokenizer (loaded from ``model_dir`` when None).
        model_id: name recorded in receipts (default: the directory name).
        device, dtype: see :func:`resolve_device_dtype`.
        threads: ``torch.set_num_threads`` (process-wide), recorded in ``identity``.
        prefix_cache_mib: memory budget of the prefix KV cache over token blocks, MiB
            (:class:`generation.engine.kv_cache.BlockPrefixCache`; 0 keeps nothing).
        stop_token_ids: ids that end an answer besides the model's EOS set (the chat
            template's end-of-turn token, e.g. Gemma's ``<end_of_turn>`` when the
            model's generation config lists only ``<eos>``).
        max_running: answers decoding together at most (the rest wait, in arrival order).
        step_token_budget: tokens one engine step carries at most (decode tokens plus
            prefill chunks; one chunk always fits).
        prefill_chunk: prefill chunk size in tokens; chunk boundaries are a pure function of
            the prompt and this number, recorded in ``identity["engine"]`` (receipts), and a
            replay passes the recorded value back (``stream(prefill_chunk=...)``).
        precision: compute precision of the linear layers, ``fp32``, ``bf16`` (fixed-tile
            bf16 GEMMs) or ``int8`` (w8a8, exact int32 accumulation, steps unpadded;
            :mod:`generation.precision`), recorded in ``identity["precision"]`` and
            ``identity["engine"]["precision"]`` as ``fp32``, ``bf16-tile<T>`` or ``int8-w8a8``.
        tile_rows: rows per bf16 GEMM tile (``T``; ignored in fp32).
        warm_turns: finished answers whose tails the engine prefills into the prefix cache while
            idle, newest first (:mod:`generation.engine.core`, "Warm work"); 0 (default) turns
            it off. The app sets it from ``RAGBUDGET_GENERATOR_WARM_TURNS``.
        turn_close_ids: the ids a follow-up places right after an answer's output (the chat
            template's end of turn and next user header,
            ``app.prompting.prompt.PromptBuilder.turn_close_ids``), warmed with it; None warms
            the prompt and output alone.

    Raises:
        InvalidConfig: bad device/dtype, engine settings below 1 (``warm_turns`` below 0), a
            precision this CPU cannot run (:func:`generation.precision.check_precision`), or a
            directory transformers cannot load.
    """

    def __init__(self, model_dir: Path | str, *, tokenizer: TextTokenizer | None = None,
                 model_id: str | None = None, device: str = "auto", dtype: str = "auto",
                 threads: int = 2, prefix_cache_mib: float = DEFAULT_PREFIX_CACHE_MIB,
                 stop_token_ids: list[int] | None = None, max_running: int = 8,
                 step_token_budget: int = 256, prefill_chunk: int = 256,
                 precision: str = "fp32", tile_rows: int = DEFAULT_TILE_ROWS, warm_turns: int = 0,
                 turn_close_ids: list[int] | None = None) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        from foundation.quiet import quiet_weight_loading
        from generation.assets import load_tokenizer, weights_hash

        if min(max_running, step_token_budget, prefill_chunk) < 1 or warm_turns < 0:
            raise InvalidConfig("max_running, step_token_budget and prefill_chunk must be >= 1, "
                                "warm_turns >= 0")
        self.warm_turns = int(warm_turns)
        self.turn_close_ids = tuple(int(i) for i in turn_close_ids or ())
        model_dir = Path(model_dir)
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        check_precision(precision, self.device, self.dtype, tile_rows)
        if precision in ("int8", "int8a16"):
            compute_call(check_int8_kernel)  # torch._int_mm present and exact, or InvalidConfig
        self.precision = precision_label(precision, tile_rows)
        # int8 steps run unpadded: its GEMMs are exact whatever the row count
        self.pad_rows = pads_rows(precision) or self.device != "cpu"
        self.threads = threads
        register_packed_attention()

        def load() -> Any:  # on the compute thread: its OpenMP team is the only one
            with torch_threads(threads, restore=False), quiet_weight_loading():
                model = AutoModelForCausalLM.from_pretrained(
                    str(model_dir), dtype=getattr(torch, self.dtype), local_files_only=True,
                    attn_implementation=ATTN_NAME)
                model = model.to(self.device).eval()  # type: ignore[arg-type]
                # counted before a tied LM head gets its own bf16 copy (roofline prior)
                self._num_parameters = int(model.num_parameters())
                apply_precision(model, precision, tile_rows)  # weights to bf16 once, here
            return model

        try:
            self.model = compute_call(load)
        except (OSError, ValueError) as exc:
            raise InvalidConfig(f"cannot load a causal LM from {model_dir}: {exc}") from exc
        self.config = self.model.config
        self.tokenizer: TextTokenizer = tokenizer or HFTextTokenizer(load_tokenizer(model_dir),
                                                                     name=str(model_dir))
        self.context_window = int(getattr(self.config, "max_position_embeddings", 2048))
        self.eos_token_ids = sorted(set(self._eos_ids()) | {int(i) for i in stop_token_ids or []})
        self.model_id = model_id or model_dir.name
        self.prefill_chunk = prefill_chunk
        # CUDA: one fixed row count per step (cuBLAS chooses kernels by shape); CPU: padded_rows().
        fixed_rows = (max(max_running, step_token_budget) + prefill_chunk
                      if self.device == "cuda" else None)
        self.fixed_rows = fixed_rows
        self.identity: dict[str, Any] = {
            "backend": "local",
            "model_id": self.model_id,
            "model_dir": str(model_dir.resolve()),
            "weights_hash": weights_hash(model_dir),
            "dtype": self.dtype,
            "precision": self.precision,
            "device": self.device,
            "device_name": _device_name(self.device),
            "threads": threads,
            "context_window": self.context_window,
            "tokenizer_id": self.tokenizer.tokenizer_id,
            "engine": {"kind": "continuous-batching", "prefill_chunk": prefill_chunk,
                       "precision": self.precision,
                       "row_padding": (f"fixed:{fixed_rows}" if fixed_rows
                                       else f"min{MIN_ROWS}x{ROW_MULTIPLE}" if self.pad_rows
                                       else "none")},
            "software": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
        }
        # The cache's root names the precision (fp32 keeps the root it always had): K/V computed
        # in one precision are never served to another.
        root = self.model_id + "@" + self.identity["weights_hash"]
        self.prefix_cache = BlockPrefixCache(root if self.precision == "fp32" else f"{root}/{self.precision}",
                                             self.device, self.dtype, chunk=prefill_chunk,
                                             budget_mib=prefix_cache_mib)
        self._lock = threading.Lock()
        self.engine = Engine(self.model, self.device, self._lock, self._prefix_lookup,
                             self._prefix_store, max_running, step_token_budget, fixed_rows,
                             prefix_known=self.prefix_cached, threads=threads,
                             prefix_cache=self.prefix_cache, pad_rows=self.pad_rows,
                             warm_turns=self.warm_turns)

    @property
    def max_running(self) -> int:
        """Answers the engine runs at once (the answer queue lets this many in)."""
        return int(self.engine.max_running)

    # --- public contract ----------------------------------------------------------
    def stream(self, prompt_ids: list[int], *, cached_prefix_ids: list[int] | None = None,
               params: GenParams, cancel: threading.Event | None = None,
               messages: list[dict[str, str]] | None = None,
               prefill_chunk: int | None = None) -> TokenStream:
        """See :meth:`generation.base.Generator.stream` (``messages`` is ignored here).

        The answer is in the engine's queue when this returns (its prefill order is taken
        now: answers started later prefill after it; its ``batch_snapshot`` shows it), unless
        ``cancel`` is already set. ``prefill_chunk`` overrides the configured chunk size
        (replay passes the one a receipt recorded).

        Raises:
            InvalidInput: empty prompt, ``prefill_chunk < 1``, or parameters outside their
                ranges (:meth:`GenParams.validate`, code ``invalid_sampling_parameter``);
                TooLarge: prompt does not leave room for one token.
        """
        if not prompt_ids:
            raise InvalidInput("the prompt is empty")
        if len(prompt_ids) >= self.context_window:
            raise TooLarge(f"prompt of {len(prompt_ids)} tokens does not fit the context window "
                           f"of {self.context_window}", prompt_tokens=len(prompt_ids))
        params.validate()
        if prefill_chunk is not None and prefill_chunk < 1:
            raise InvalidInput("prefill_chunk must be >= 1")
        prefix = list(cached_prefix_ids or [])
        if not prefix or len(prefix) > len(prompt_ids) or prompt_ids[:len(prefix)] != prefix:
            prefix = []
        ids, resolved, chunk = list(prompt_ids), params.resolved(), prefill_chunk or self.prefill_chunk
        return TokenStream(lambda stream: self._run(stream, ids, prefix, resolved, cancel, chunk))

    def prefix_cached(self, prefix_ids: list[int]) -> bool:
        """True when the prefix cache holds the KV cache of exactly ``prefix_ids``."""
        return list(prefix_ids) in self.prefix_cache

    @on_compute_thread
    def warm_prefix(self, prefix_ids: list[int]) -> float:
        """Compute and store the KV cache of ``prefix_ids`` (under the model lock); ms spent."""
        t0 = time.perf_counter()
        ids = list(prefix_ids)
        if ids and ids not in self.prefix_cache:
            with self._lock:
                self.engine.run_alone(self._sequence(ids, len(ids), GenParams(max_new_tokens=1)))
        return (time.perf_counter() - t0) * 1000.0

    @on_compute_thread
    def prefill_ms(self, prompt_tokens: int, cached_tokens: int, *,
                   prefix_tokens: int | None = None, steps: list[StepRecord] | None = None) -> float:
        """Time the engine's prefill of one answer alone: cache copy + chunked prefill + first token, ms.

        ``prefix_tokens`` is the scaffold boundary the engine chunks at (default
        ``cached_tokens``): ``(n, 0, prefix_tokens=P)`` times a cache miss on a ``P``-token
        scaffold (the scaffold in its own chunks, then the rest, its KV stored for the next
        request, as an answer does), ``(n, P)`` a hit. A cached prefix is computed first,
        untimed, and kept out of the LRU. CUDA work is synchronised before and after the
        timed section. ``steps``, when given, receives the timed run's engine steps
        (:class:`generation.engine.messages.StepRecord`, oldest first): what a cache miss computes
        that a hit does not can then be read step by step.

        Raises:
            InvalidInput: not ``0 <= cached_tokens <= prompt_tokens < context_window``, or a
                ``prefix_tokens`` that is neither ``cached_tokens`` nor, with nothing cached,
                at most ``prompt_tokens``.
        """
        if not 0 <= cached_tokens <= prompt_tokens or not 1 <= prompt_tokens < self.context_window:
            raise InvalidInput(f"bad prefill shape n={prompt_tokens} c={cached_tokens}")
        prefix = cached_tokens if prefix_tokens is None else int(prefix_tokens)
        if prefix != cached_tokens and (cached_tokens or not 0 <= prefix <= prompt_tokens):
            raise InvalidInput(f"bad prefix boundary {prefix} for n={prompt_tokens} c={cached_tokens}")
        ids = self._synthetic_ids(prompt_tokens)
        with self._lock:
            detached: dict[str, Any] = {}
            if cached_tokens:
                seq = self._sequence(ids[:cached_tokens], cached_tokens, GenParams(max_new_tokens=1))
                self._run_detached(seq, detached)
            seq = self._sequence(ids, prefix, GenParams(max_new_tokens=1))
            self._sync()
            t0 = time.perf_counter()
            engine = self._run_detached(seq, detached)
            self._sync()
            ms = (time.perf_counter() - t0) * 1000.0
            if steps is not None:
                steps.extend(engine.recent_steps())
            return ms

    @on_compute_thread
    def decode_step_ms(self, context_tokens: int) -> float:
        """Time one engine decode step of one answer alone after ``context_tokens``, ms.

        The step writes position ``context_tokens`` and yields a second token, so the
        context must leave room for both.

        Raises:
            InvalidInput: not ``1 <= context_tokens <= context_window - 2``.
        """
        if not 1 <= context_tokens <= self.context_window - 2:
            raise InvalidInput(f"bad decode context {context_tokens}: a decode step needs "
                               f"1 <= context <= {self.context_window - 2}")
        ids = self._synthetic_ids(context_tokens)
        with self._lock:
            seq = self._sequence(ids, 0, GenParams(max_new_tokens=2), eos=frozenset())
            self.engine.run_alone(seq)
            if seq.done:  # never time an empty step
                raise InvalidInput(f"decode context {context_tokens}: the answer ended at its first token")
            self._sync()
            t0 = time.perf_counter()
            self._run_step([seq])
            self._sync()
            return (time.perf_counter() - t0) * 1000.0

    @on_compute_thread
    def step_ms(self, prefill_tokens: int, prefill_pos: int, decode_contexts: list[int],
                prefill_needs_logits: bool = True) -> float:
        """Time one engine step of a mixed batch, ms: one prefill chunk of ``prefill_tokens`` at
        positions ``[prefill_pos, prefill_pos + prefill_tokens)`` (0: none) plus one decode token
        for each context length in ``decode_contexts`` (at most ``max_running`` of them).

        The answers' KV buffers are stand-ins (allocated, zeroed, untimed): a step's time
        depends on the shapes, not on the values. ``prefill_needs_logits`` False makes the
        chunk one that does not end its prompt (no LM-head row for it), as a step that
        prefills the middle of a prompt is. CUDA work is synchronised around the step.

        Raises:
            InvalidInput: negative counts, an empty step, more decode answers than
                ``max_running``, or a position past the context window.
        """
        ctxs = [int(x) for x in decode_contexts]
        if prefill_tokens < 0 or prefill_pos < 0 or any(x < 1 for x in ctxs):
            raise InvalidInput("step shape counts must be >= 0 (decode contexts >= 1)")
        if not prefill_tokens and not ctxs:
            raise InvalidInput("a step carries at least one token")
        if len(ctxs) > self.max_running:
            raise InvalidInput(f"{len(ctxs)} decode answers exceed max_running={self.max_running}")
        if max([prefill_pos + prefill_tokens + 1, *(x + 1 for x in ctxs)]) >= self.context_window:
            raise InvalidInput("step shape past the context window")
        c = self.config
        heads = int(c.num_attention_heads)
        kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        import torch

        dtype = getattr(torch, self.dtype)  # the K/V dtype (bf16 linears still emit fp32)
        tok = self._synthetic_ids(1)[0]
        seqs: list[Request] = []

        def stand_in(prompt_len: int, pos: int, chunk: int) -> Request:
            seq = self._sequence(self._synthetic_ids(prompt_len), 0, GenParams(max_new_tokens=2),
                                 chunk=chunk, eos=frozenset())
            seq.kv = SeqKV(prompt_len + 3)
            seq.kv.allocate(int(c.num_hidden_layers), kv_heads, head_dim, dtype, self.device)
            seq.pos, seq.admitted_t = pos, time.perf_counter()
            return seq

        for x in ctxs:
            seq = stand_in(x, x, 1)
            seq.next_tok = tok
            seqs.append(seq)
        if prefill_tokens:
            end = prefill_pos + prefill_tokens
            seqs.append(stand_in(end + (0 if prefill_needs_logits else 1), prefill_pos, prefill_tokens))
        with self._lock:
            self._sync()
            t0 = time.perf_counter()
            self._run_step(seqs)
            self._sync()
            return (time.perf_counter() - t0) * 1000.0

    def config_dict(self) -> dict[str, Any]:
        """HF config fields the roofline prior needs, plus ``num_parameters`` and bytes per parameter."""
        c = self.config
        heads = int(c.num_attention_heads)
        return {
            "model_type": getattr(c, "model_type", None),
            "num_parameters": self._num_parameters,
            "num_hidden_layers": int(c.num_hidden_layers),
            "hidden_size": int(c.hidden_size),
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            "vocab_size": int(c.vocab_size),
            "intermediate_size": int(getattr(c, "intermediate_size", 4 * c.hidden_size)),
            "max_position_embeddings": self.context_window,
            "dtype": self.dtype,
            # weights read per step: bf16 keeps its linear layers in 2 bytes, int8 in 1
            "bytes_per_param": (1 if self.precision.startswith("int8") else 2 if self.precision != "fp32"
                                else {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]),
        }

    # --- one answer through the engine ----------------------------------------------
    def _sequence(self, prompt_ids: list[int], prefix_len: int, params: GenParams,
                  cancel: threading.Event | None = None, chunk: int | None = None,
                  eos: frozenset[int] | None = None) -> Request:
        rng = self._rng(params)
        max_new = max(1, min(params.max_new_tokens, self.context_window - len(prompt_ids)))
        return Request(prompt=prompt_ids, prefix_len=prefix_len, max_new=max_new,
                        chunk=chunk or self.prefill_chunk,
                        select=lambda logits: select_token(logits, params, rng),
                        eos=frozenset(self.eos_token_ids) if eos is None else eos, cancel=cancel,
                        min_new=min(params.min_tokens, max_new), ignore_eos=params.ignore_eos)

    def _run_step(self, seqs: list[Request]) -> None:
        """One step of ``seqs`` (at most one of them prefilling) as the engine runs it, through
        the public API of its rooms: the scheduler's plan, the runner's forward, each answer's
        sampler on its logits row; the answers are not moved on. What the step timers time."""
        plan = schedule(seqs, None)
        logits = self.engine.runner.run(plan, seqs)  # (plan.logit_rows, vocab)
        rows = [c for c in plan.chunks if c.needs_logits]
        for row, c in enumerate(rows):
            if c.decode or c.start + c.tokens == seqs[c.index].prompt_len:  # a token is chosen
                seqs[c.index].select(logits[row])

    def _run_detached(self, seq: Request, store: dict[str, Any]) -> Engine:
        """Run ``seq`` alone to its first token with a private prefix store (calibration);
        returns the private engine it ran on (its step log holds the run's steps)."""
        engine = Engine(self.model, self.device, self._lock,
                        lambda ids: store.get("entry") if store.get("len") == len(ids) else None,
                        lambda ids, kv, lg: store.update({"entry": (kv, lg), "len": len(ids)}),
                        1, 1 << 30, self.fixed_rows, threads=self.threads,
                        pad_rows=self.pad_rows)
        engine.run_alone(seq)
        return engine

    def _run(self, stream: TokenStream, prompt_ids: list[int], prefix: list[int], params: GenParams,
             cancel: threading.Event | None, chunk: int) -> StreamBody:
        """The body of one answer's :class:`TokenStream`: queued in the engine before its first
        ``yield``, then its tokens as the engine routes them; the stats set on every path."""
        stats = GenerationStats(prompt_tokens=len(prompt_ids), cached_tokens=0,
                                computed_tokens=len(prompt_ids), output_token_ids=[],
                                finish_reason="length", prefill_ms=0.0, first_token_t=None,
                                last_token_t=None, params=params)
        detok = IncrementalDetokenizer(self.tokenizer.decode)
        seq = self._sequence(prompt_ids, len(prefix), params, cancel, chunk)
        if self.warm_turns:  # ended normally, its tail is warmed for a follow-up
            seq.tail_ids = self.turn_close_ids
        submitted = ended = False
        try:
            stats.start_t = time.perf_counter()
            if cancel is not None and cancel.is_set():
                stats.finish_reason = "cancelled"
                return
            self.engine.submit(seq)
            submitted = True
            stream.accepted_t = time.perf_counter()
            yield None  # accepted: in the engine's queue when stream() returns
            index = 0
            while True:
                try:
                    msg = seq.out.get(timeout=0.05)
                except queue.Empty:
                    if cancel is not None and cancel.is_set():
                        stats.finish_reason = "cancelled"
                        return
                    continue
                if isinstance(msg, Admitted):
                    stats.start_t = msg.start_t
                    stats.cached_tokens = msg.cached_tokens
                    stats.computed_tokens = len(prompt_ids) - stats.cached_tokens
                    continue
                if isinstance(msg, Finished):
                    ended = True
                    reason, exc = msg.reason, msg.error
                    if exc is not None:
                        stats.finish_reason = "error"
                        if isinstance(exc, RagBudgetError):
                            stats.error = str(exc)
                            raise exc
                        stats.error = f"{type(exc).__name__}: {exc}"
                        raise BackendError(f"local generation failed: {exc}") from exc
                    stats.finish_reason = reason
                    if reason == "stop" and stats.first_token_t is None and stats.start_t is not None:
                        stats.prefill_ms = (time.perf_counter() - stats.start_t) * 1000.0
                    return
                tok, t = msg.token_id, msg.t
                if stats.first_token_t is None:
                    stats.first_token_t = t
                    stats.prefill_ms = (t - (stats.start_t or t)) * 1000.0
                stats.output_token_ids.append(tok)
                text = detok.add(tok)
                if text and stats.first_text_t is None:
                    stats.first_text_t = t
                stats.last_token_t = t
                yield TokenEvent(index, tok, text, t)
                index += 1
                if cancel is not None and cancel.is_set():
                    stats.finish_reason = "cancelled"
                    return
        except GeneratorExit:
            stats.finish_reason = "cancelled"
            raise
        finally:
            if submitted and not ended:
                # Leave the engine now and wait (at most a step) until it has dropped this
                # answer, so a closed stream no longer holds any of the model's time.
                seq.closed = True
                self.engine.wake()
                deadline = time.perf_counter() + 60.0
                while time.perf_counter() < deadline:
                    try:
                        if isinstance(seq.out.get(timeout=0.05), Finished):
                            break
                    except queue.Empty:
                        continue
            stream.stats = stats

    # --- prefix cache glue ------------------------------------------------------------
    def _prefix_lookup(self, prefix_ids: list[int]) -> tuple[Any, Any] | None:
        entry = self.prefix_cache.get(prefix_ids)
        if entry is None:
            return None
        entry.hits += 1
        return entry.kv, entry.last_logits

    def _prefix_store(self, prefix_ids: list[int], kv: Any, last_logits: Any) -> None:
        self.prefix_cache.put(prefix_ids, kv, last_logits, 0.0)

    @staticmethod
    def _rng(params: GenParams) -> Any:
        import torch

        if params.greedy:
            return None
        return torch.Generator(device="cpu").manual_seed(int(params.seed or 0))

    def _sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def _synthetic_ids(self, n: int) -> list[int]:
        """``n`` deterministic ids from the middle of the vocabulary (no special tokens)."""
        vocab = int(self.config.vocab_size)
        r = random.Random(n)
        return [r.randrange(vocab // 10, vocab * 9 // 10) for _ in range(n)]

    def _eos_ids(self) -> list[int]:
        found: set[int] = set()
        gen_cfg = getattr(self.model, "generation_config", None)
        for src in (getattr(gen_cfg, "eos_token_id", None), getattr(self.config, "eos_token_id", None),
                    getattr(getattr(self.tokenizer, "hf", None), "eos_token_id", None)):
            if isinstance(src, int):
                found.add(src)
            elif isinstance(src, list | tuple):
                found.update(int(i) for i in src)
        return sorted(found)
