"""The local backend: a Hugging Face transformers causal LM with a manual decode loop.

A hand-written loop (not ``model.generate``) so that the scaffold's KV cache can
be injected, cancellation is checked between tokens, and every token carries
its own ``time.perf_counter()`` stamp. transformers 5.x takes the cache as
``cache=`` (``past_key_values=`` is deprecated since 5.x, removal announced for
5.40; verified with 5.24) and returns it, extended in place, as ``output.cache``.

One generation runs at a time per model (``self._lock``); the answer pipeline
queues requests in front of it.
"""

from __future__ import annotations

import platform
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from foundation.errors import BackendError, InvalidConfig, InvalidInput, RagBudgetError, TooLarge
from generation.base import (
    GenerationStats,
    GenParams,
    IncrementalDetokenizer,
    TokenEvent,
)
from generation.prefix_cache import PrefixEntry, PrefixKVCache
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
        prefix_cache_capacity: scaffolds kept in the prefix KV cache.
        stop_token_ids: ids that end an answer besides the model's EOS set (the chat
            template's end-of-turn token, e.g. Gemma's ``<end_of_turn>`` when the
            model's generation config lists only ``<eos>``).

    Raises:
        InvalidConfig: bad device/dtype or a directory transformers cannot load.
    """

    def __init__(self, model_dir: Path | str, *, tokenizer: TextTokenizer | None = None,
                 model_id: str | None = None, device: str = "auto", dtype: str = "auto",
                 threads: int = 2, prefix_cache_capacity: int = 4,
                 stop_token_ids: list[int] | None = None) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        from foundation.quiet import quiet_weight_loading
        from generation.assets import load_tokenizer, weights_hash

        model_dir = Path(model_dir)
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        torch.set_num_threads(threads)
        self.threads = threads
        try:
            with quiet_weight_loading():
                model = AutoModelForCausalLM.from_pretrained(
                    str(model_dir), dtype=getattr(torch, self.dtype), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise InvalidConfig(f"cannot load a causal LM from {model_dir}: {exc}") from exc
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.config = self.model.config
        self.tokenizer: TextTokenizer = tokenizer or HFTextTokenizer(load_tokenizer(model_dir),
                                                                     name=str(model_dir))
        self.context_window = int(getattr(self.config, "max_position_embeddings", 2048))
        self.eos_token_ids = sorted(set(self._eos_ids()) | {int(i) for i in stop_token_ids or []})
        self.model_id = model_id or model_dir.name
        self.identity: dict[str, Any] = {
            "backend": "local",
            "model_id": self.model_id,
            "model_dir": str(model_dir.resolve()),
            "weights_hash": weights_hash(model_dir),
            "dtype": self.dtype,
            "device": self.device,
            "device_name": _device_name(self.device),
            "threads": threads,
            "context_window": self.context_window,
            "tokenizer_id": self.tokenizer.tokenizer_id,
            "software": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
        }
        self.prefix_cache = PrefixKVCache(self.model_id + "@" + self.identity["weights_hash"],
                                          self.device, self.dtype, prefix_cache_capacity)
        self.last_stats: GenerationStats | None = None
        self._lock = threading.Lock()

    # --- public contract ----------------------------------------------------------
    def stream(self, prompt_ids: list[int], *, cached_prefix_ids: list[int] | None = None,
               params: GenParams, cancel: threading.Event | None = None,
               messages: list[dict[str, str]] | None = None) -> Iterator[TokenEvent]:
        """See :meth:`generation.base.Generator.stream` (``messages`` is ignored here).

        Validation happens now; the model lock is taken when iteration starts.

        Raises:
            InvalidInput: empty prompt; TooLarge: prompt does not leave room for one token.
        """
        if not prompt_ids:
            raise InvalidInput("the prompt is empty")
        if len(prompt_ids) >= self.context_window:
            raise TooLarge(f"prompt of {len(prompt_ids)} tokens does not fit the context window "
                           f"of {self.context_window}", prompt_tokens=len(prompt_ids))
        if params.max_new_tokens < 1:
            raise InvalidInput("max_new_tokens must be >= 1")
        prefix = list(cached_prefix_ids or [])
        if not prefix or len(prefix) > len(prompt_ids) or prompt_ids[:len(prefix)] != prefix:
            prefix = []
        return self._run(list(prompt_ids), prefix, params.resolved(), cancel)

    def prefix_cached(self, prefix_ids: list[int]) -> bool:
        """True when the prefix cache holds the KV cache of exactly ``prefix_ids``."""
        return list(prefix_ids) in self.prefix_cache

    def warm_prefix(self, prefix_ids: list[int]) -> float:
        """Compute and store the KV cache of ``prefix_ids`` (under the model lock); ms spent."""
        t0 = time.perf_counter()
        with self._lock:
            self.prefix_cache.get_or_compute(list(prefix_ids), self._compute_prefix)
        return (time.perf_counter() - t0) * 1000.0

    def prefill_ms(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Time the stream() prefill path on synthetic ids: cache copy + prefill + first token, ms.

        The ``cached_tokens`` prefix is computed first, untimed and outside the LRU.
        CUDA work is synchronised before and after the timed section.

        Raises:
            InvalidInput: not ``0 <= cached_tokens <= prompt_tokens < context_window``.
        """
        if not 0 <= cached_tokens <= prompt_tokens or not 1 <= prompt_tokens < self.context_window:
            raise InvalidInput(f"bad prefill shape n={prompt_tokens} c={cached_tokens}")
        ids = self._synthetic_ids(prompt_tokens)
        with self._lock:
            entry = self._detached_entry(ids[:cached_tokens]) if cached_tokens else None
            self._sync()
            t0 = time.perf_counter()
            _kv, logits = self._prefill_after(entry, ids[cached_tokens:])
            self._select(logits, GenParams(), None)
            self._sync()
            return (time.perf_counter() - t0) * 1000.0

    def decode_step_ms(self, context_tokens: int) -> float:
        """Time one stream() decode step (forward of one token + selection) after ``context_tokens``, ms.

        Raises:
            InvalidInput: not ``1 <= context_tokens < context_window``.
        """
        if not 1 <= context_tokens < self.context_window:
            raise InvalidInput(f"bad decode context {context_tokens}")
        ids = self._synthetic_ids(context_tokens + 1)
        with self._lock:
            kv, _ = self._compute_prefix(ids[:context_tokens])
            self._sync()
            t0 = time.perf_counter()
            logits = self._forward([ids[-1]], kv)
            self._select(logits, GenParams(), None)
            self._sync()
            return (time.perf_counter() - t0) * 1000.0

    def config_dict(self) -> dict[str, Any]:
        """HF config fields the roofline prior needs, plus ``num_parameters`` and bytes per parameter."""
        c = self.config
        heads = int(c.num_attention_heads)
        return {
            "model_type": getattr(c, "model_type", None),
            "num_parameters": int(self.model.num_parameters()),
            "num_hidden_layers": int(c.num_hidden_layers),
            "hidden_size": int(c.hidden_size),
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            "vocab_size": int(c.vocab_size),
            "intermediate_size": int(getattr(c, "intermediate_size", 4 * c.hidden_size)),
            "max_position_embeddings": self.context_window,
            "dtype": self.dtype,
            "bytes_per_param": {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype],
        }

    # --- the decode loop ------------------------------------------------------------
    def _run(self, prompt_ids: list[int], prefix: list[int], params: GenParams,
             cancel: threading.Event | None) -> Iterator[TokenEvent]:
        max_new = min(params.max_new_tokens, self.context_window - len(prompt_ids))
        stats = GenerationStats(prompt_tokens=len(prompt_ids), cached_tokens=0,
                                computed_tokens=len(prompt_ids), output_token_ids=[],
                                finish_reason="length", prefill_ms=0.0, first_token_t=None,
                                last_token_t=None, params=params)
        detok = IncrementalDetokenizer(self.tokenizer.decode)
        eos = set(self.eos_token_ids)
        rng = self._rng(params)
        with self._lock:
            try:
                stats.start_t = time.perf_counter()
                if cancel is not None and cancel.is_set():
                    stats.finish_reason = "cancelled"
                    return
                entry: PrefixEntry | None = None
                if prefix:
                    entry, hit = self.prefix_cache.get_or_compute(prefix, self._compute_prefix)
                    if hit:
                        stats.cached_tokens = len(prefix)
                        stats.computed_tokens = len(prompt_ids) - len(prefix)
                kv, logits = self._prefill_after(entry, prompt_ids[len(prefix):])
                tok = self._select(logits, params, rng)
                t = time.perf_counter()
                stats.prefill_ms = (t - stats.start_t) * 1000.0
                for index in range(max_new):
                    if tok in eos:
                        stats.finish_reason = "stop"
                        break
                    stats.output_token_ids.append(tok)
                    text = detok.add(tok)
                    if stats.first_token_t is None:
                        stats.first_token_t = t
                    if text and stats.first_text_t is None:
                        stats.first_text_t = t
                    stats.last_token_t = t
                    yield TokenEvent(index, tok, text, t)
                    if cancel is not None and cancel.is_set():
                        stats.finish_reason = "cancelled"
                        break
                    if index + 1 == max_new:
                        break
                    tok = self._select(self._forward([tok], kv), params, rng)
                    t = time.perf_counter()
            except GeneratorExit:
                stats.finish_reason = "cancelled"
                raise
            except RagBudgetError as exc:
                stats.finish_reason, stats.error = "error", str(exc)
                raise
            except Exception as exc:
                stats.finish_reason, stats.error = "error", f"{type(exc).__name__}: {exc}"
                raise BackendError(f"local generation failed: {exc}") from exc
            finally:
                self.last_stats = stats

    # --- model steps (shared by stream() and the calibration timers) ----------------
    def _forward(self, ids: list[int], kv: Any) -> Any:
        """Run ``ids`` through the model, extending ``kv`` in place; next-token logits ``(vocab,)``."""
        import torch

        with torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            out = self.model(input_ids=x, cache=kv, use_cache=True, logits_to_keep=1)
            return out.logits[0, -1]

    def _new_kv(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def _compute_prefix(self, prefix_ids: list[int]) -> tuple[Any, Any]:
        kv = self._new_kv()
        logits = self._forward(list(prefix_ids), kv)
        return kv, logits

    def _detached_entry(self, prefix_ids: list[int]) -> PrefixEntry:
        kv, logits = self._compute_prefix(prefix_ids)
        return PrefixEntry(self.prefix_cache.key(prefix_ids), tuple(prefix_ids), kv, logits, 0.0)

    def _prefill_after(self, entry: PrefixEntry | None, rest_ids: list[int]) -> tuple[Any, Any]:
        """Copy ``entry``'s KV (or start empty) and prefill ``rest_ids``; ``(kv, logits)``."""
        if entry is None:
            kv = self._new_kv()
            return kv, self._forward(rest_ids, kv)
        kv = PrefixKVCache.copy_kv(entry)
        if not rest_ids:
            return kv, entry.last_logits
        return kv, self._forward(rest_ids, kv)

    def _select(self, logits: Any, params: GenParams, rng: Any) -> int:
        """Greedy argmax, or temperature + top-p (nucleus) sampling with a seeded generator."""
        import torch

        if params.greedy:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < params.top_p
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=rng)
            return int(order[choice].item())
        return int(torch.multinomial(probs, 1, generator=rng).item())

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
