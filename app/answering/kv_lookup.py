"""What an engine's prefix cache holds of each candidate prompt, for the planner.

The local engine keeps a prefix KV cache over token blocks (scaffold, retrieved chunks,
earlier turns: :class:`generation.engine.kv_cache.BlockPrefixCache`). Before the planner
chooses ``k`` it asks, for every candidate prompt ``k = 0..K`` (:meth:`app.prompting.prompt.Prompt.ids_for`),
how many of its leading tokens an answer admitted now would load
(:meth:`generation.engine.core.Engine.cached_tokens`, the scaffold as the engine's chunking
prefix, the generator's prefill chunk), so warm chunks are priced as cached
(:func:`latency_model.planner.plan`, ``cached_tokens``).

Nothing is pinned between this look-up and the answer's admission: a block evicted meanwhile
is computed again (the answer is exact either way; only its prefill takes longer than
planned, which the online correction sees as any other misprediction). The plan is looked
up again when the request gets the model (late binding), which narrows that window to the
time between the grant and the engine's admission.

An engine that cannot say (a remote server, a generator without a block cache) gives None:
the planner then counts the scaffold alone, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from generation.base import SupportsEngine, SupportsPrefillChunk, SupportsPrefixLookup

if TYPE_CHECKING:
    from app.prompting.prompt import Prompt


def cached_per_k(generator: object, full: Prompt) -> tuple[int, ...] | None:
    """``(K + 1,)`` cached tokens of ``full``'s prompt with ``k`` chunks for ``k = 0..K``, or None
    when ``generator`` has no engine that reports them (see module).

    Each count is in ``[0, full.prompt_tokens_for(k)]``: the end of the longest cached chain of
    that prompt's blocks (the whole prompt only when the logits after it are cached too).
    """
    if not (isinstance(generator, SupportsEngine) and isinstance(generator, SupportsPrefillChunk)):
        return None
    engine, chunk = generator.engine, generator.prefill_chunk
    if not isinstance(engine, SupportsPrefixLookup) or not isinstance(chunk, int) or chunk < 1:
        return None
    k_max = len(full.chunk_token_counts)  # K: the candidate prompts are k = 0..K
    return tuple(int(engine.cached_tokens(full.ids_for(k), full.scaffold_len, chunk))
                 for k in range(k_max + 1))
