"""Where the scaffold prefix cache used to live: re-exported from
:mod:`generation.engine.kv_cache` (its home in the engine's rooms) so the old import path keeps
working."""

from __future__ import annotations

from generation.engine.kv_cache import PrefixEntry, PrefixKVCache

__all__ = ["PrefixEntry", "PrefixKVCache"]
