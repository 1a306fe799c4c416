"""Where the prefix cache used to live: re-exported from :mod:`generation.engine.kv_cache` (its
home in the engine's rooms) so the old import path keeps working. The scaffold-only LRU
(``PrefixKVCache``) became :class:`BlockPrefixCache`, a cache over token blocks whose first
block is the scaffold."""

from __future__ import annotations

from generation.engine.kv_cache import BlockPrefixCache, CachedBlock

__all__ = ["BlockPrefixCache", "CachedBlock"]
