"""Generation: the engine room. The :class:`~generation.base.Generator` contract and its backends.

* :mod:`generation.base`: parameters, streamed token events, per-answer statistics, the protocol.
* :mod:`generation.local`: a transformers causal LM with a scaffold prefix KV cache, run by
  the local engine (:mod:`generation.engine`: request, scheduler, runner, KV cache, core,
  messages; :mod:`generation.scheduler` and :mod:`generation.prefix_cache` keep old import paths).
* :mod:`generation.remote`, :mod:`generation.remote_tokenizer`: an OpenAI-compatible server;
  :mod:`generation.remote_text`: token-id prompts for text-only servers (llama-cpp-python).
* :mod:`generation.assets`: the generator's model files (packaged models, GGUF conversion, weights hash).
* :mod:`generation.chat_template`: which chat template frames the prompt (never a silent default).

This room imports ``foundation`` and ``retrieval.tokens`` (the tokenizer
protocol) only; choosing and configuring a backend is the app's wiring
(``app.services``). Nothing heavy is imported here.
"""

from __future__ import annotations

from generation.base import GenerationStats, Generator, GenParams, TokenEvent

__all__ = ["Generator", "GenerationStats", "GenParams", "TokenEvent"]

import foundation  # noqa: F401  (sets the OpenMP spin count before torch loads)
