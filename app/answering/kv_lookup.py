"""What an engine's prefix cache holds of each candidate prompt, for the planner.

The local engine keeps a prefix KV cache over token blocks (scaffold, retrieved chunks,
earlier turns: :class:`generation.engine.kv_cache.BlockPrefixCache`). Before the planner
chooses ``k`` it asks, for every candidate prompt ``k = 0..K`` (:meth:`app.prompting.prompt.Prompt.ids_for`),
how many of its leading tokens an answer admitted now would load
(:meth:`generation.engine.core.Engine.cached_tokens`, the scaffold as the engine's chunking
prefix, the generator's prefill chunk), so warm chunks are priced as cached
(:func:`latency_model.planner.plan`, ``cached_tokens``).

The plan is looked up again when the request gets the model (late binding); right after
that last look, under the engine's admit lock, the chosen prompt's cached chain is pinned
(:func:`pin_prompt`, :meth:`generation.engine.core.Engine.pin`) until the engine admits the
answer, so the blocks it was priced with are still there when it is admitted. The pin is
released by the admission, or by the caller when the answer ends without one (cancelled,
refused, failed). What is left unpinned is the moment between the look and the pin (an engine
step storing a block then may evict one), and the candidates not chosen.

A remote server cannot be asked; its generator predicts from what it sent and from the cached
counts the server reported (:mod:`generation.remote_cache`: the scaffold alone until four answers
were learned, nothing when the server gives no hits). A generator without a block cache gives
None: the planner then counts the scaffold alone, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from generation.base import SupportsEngine, SupportsPrefillChunk, SupportsPrefixLookup, SupportsPrefixPin

if TYPE_CHECKING:
    from app.prompting.prompt import Prompt


def cached_per_k(generator: object, full: Prompt) -> tuple[int, ...] | None:
    """``(K + 1,)`` cached tokens of ``full``'s prompt with ``k`` chunks for ``k = 0..K``, or None
    when ``generator`` has no engine that reports them (see module). A remote generator answers
    itself (:meth:`generation.remote.RemoteGenerator.cached_tokens`: predicted from the counts
    its server reported, :mod:`generation.remote_cache`).

    Each count is in ``[0, full.prompt_tokens_for(k)]``: the end of the longest cached chain of
    that prompt's blocks (the whole prompt only when the logits after it are cached too).
    """
    k_max = len(full.chunk_token_counts)  # K: the candidate prompts are k = 0..K
    if isinstance(generator, SupportsPrefixLookup):  # a remote engine: learned from its reports
        return tuple(int(generator.cached_tokens(full.ids_for(k), full.scaffold_len, 1))
                     for k in range(k_max + 1))
    if not (isinstance(generator, SupportsEngine) and isinstance(generator, SupportsPrefillChunk)):
        return None
    engine, chunk = generator.engine, generator.prefill_chunk
    if not isinstance(engine, SupportsPrefixLookup) or not isinstance(chunk, int) or chunk < 1:
        return None
    return tuple(int(engine.cached_tokens(full.ids_for(k), full.scaffold_len, chunk))
                 for k in range(k_max + 1))


def pin_prompt(generator: object, prompt: Prompt) -> Any | None:
    """Pin the cached chain of ``prompt`` (the one chosen) in ``generator``'s engine until the
    answer that runs it is admitted (:meth:`generation.engine.core.Engine.pin`): a handle with
    ``cached_tokens`` and an idempotent ``release()``, which the caller calls when the answer
    ends (a no-op once its admission released it). None when the engine cannot pin."""
    if not (isinstance(generator, SupportsEngine) and isinstance(generator, SupportsPrefillChunk)):
        return None
    engine, chunk = generator.engine, generator.prefill_chunk
    if not isinstance(engine, SupportsPrefixPin) or not isinstance(chunk, int) or chunk < 1:
        return None
    return engine.pin(prompt.ids, prompt.scaffold_len, chunk)
