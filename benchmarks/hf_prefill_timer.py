"""A stand-alone Hugging Face transformers timer implementing ``latency_model.calibration.PrefillTimer``.

Used by ``benchmarks/latency_model.py`` to measure a real model without the
application's generator. Prompts are slices of one fixed, seeded sequence of
token ids, so a cached prefix of ``c`` tokens is exactly the first ``c`` tokens
of the prompt. Prefix KV caches are built once per length (untimed) and
deep-copied before each use (transformers 5: the forward kwarg is ``cache=``).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from benchmarks.common import cpu_model, elapsed_ms


class HFPrefillTimer:
    """Times prefills and decode steps of a local HF causal LM (fp32 on CPU by default)."""

    def __init__(self, model_dir: str | Path, *, threads: int = 2, device: str = "cpu",
                 dtype: str = "float32", seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from generation.assets import weights_hash

        self.torch = torch
        torch.set_num_threads(threads)
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
        cfg = self.model.config
        self.context_window = int(cfg.max_position_embeddings)
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(100, cfg.vocab_size - 100, (1, self.context_window + 1),
                                 generator=gen).to(device)
        device_name = torch.cuda.get_device_name(0) if device.startswith("cuda") else cpu_model()
        self.identity: dict[str, Any] = {
            "device": device, "device_name": device_name,
            "model_id": str(getattr(cfg, "_name_or_path", "") or Path(model_dir).name),
            "weights_hash": weights_hash(Path(model_dir)), "dtype": dtype,
            "threads": threads if device == "cpu" else None,
            "context_window": self.context_window, "backend": "hf-benchmark-timer",
        }
        self._prefix: dict[int, Any] = {}

    def config_dict(self) -> dict[str, Any]:
        """The model's config as a plain dict."""
        return dict(self.model.config.to_dict())

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def _cache(self, tokens: int) -> Any:
        if tokens not in self._prefix:
            with self.torch.inference_mode():
                out = self.model(input_ids=self.ids[:, :tokens], use_cache=True, logits_to_keep=1)
            self._prefix[tokens] = out.cache
        return copy.deepcopy(self._prefix[tokens])

    def prefill_ms(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Wall ms of one prefill up to the first token's id (the cache copy is not timed)."""
        cache = self._cache(cached_tokens) if cached_tokens else None
        with self.torch.inference_mode():
            self._sync()
            t0 = time.perf_counter()
            out = self.model(input_ids=self.ids[:, cached_tokens:prompt_tokens], cache=cache,
                             use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            self._sync()
            return elapsed_ms(t0)

    def decode_step_ms(self, context_tokens: int) -> float:
        """Wall ms of one decode step after ``context_tokens`` of context."""
        cache = self._cache(context_tokens)
        with self.torch.inference_mode():
            self._sync()
            t0 = time.perf_counter()
            out = self.model(input_ids=self.ids[:, context_tokens:context_tokens + 1], cache=cache,
                             use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            self._sync()
            return elapsed_ms(t0)
