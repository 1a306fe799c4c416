"""The services container: everything heavy is loaded once per process, lazily, thread-safely.

The CLI and the API both hold one :class:`Services`. Nothing is loaded at
import time; each property loads its object on first use and caches it. Each
model property is typed by its room's protocol (``TextTokenizer``, ``Embedder``,
``RetrieverProtocol``, ``Generator``), so tests put fakes in their place by
setting ``services.__dict__[name]``.
"""

from __future__ import annotations

import threading
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine

from app.settings import EngineConfig, Settings
from foundation.errors import InvalidConfig, NotFound
from generation.base import Generator, SupportsPrefixCache
from retrieval.tokens import TextTokenizer

if TYPE_CHECKING:  # numpy / FAISS load only when a retriever is built
    from app.prompting.prompt import PromptBuilder
    from generation.engine.kv_cache import PrefixCacheStats
    from retrieval.embedding import Embedder
    from retrieval.retriever import RetrieverProtocol


class Services:
    """Lazily built, process-wide singletons for one :class:`Settings`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.RLock()

    # --- storage ---------------------------------------------------------------
    @cached_property
    def engine(self) -> Engine:
        """The database engine, migrated to head on first use."""
        from app.db import open_database

        with self._lock:
            return open_database(self.settings)

    @property
    def data_dir(self) -> Path:
        """The settings' data directory (index, models, profiles), created on first use."""
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        return self.settings.data_dir

    # --- tokenizer and chunking ---------------------------------------------------
    @cached_property
    def generator_dir(self) -> Path:
        """Local HF directory of the generator (the packaged model is converted once)."""
        from generation.assets import generator_dir

        with self._lock:
            return generator_dir(self.data_dir, self.settings.generator_path)

    @cached_property
    def tokenizer(self) -> TextTokenizer:
        """The generator's tokenizer as a ``retrieval.tokens.TextTokenizer`` (the first engine's:
        every engine of a list shares it, :meth:`engine_generator`)."""
        with self._lock:
            first = self.settings.engine_list()[0]
            if first.kind == "remote":
                return self._remote_tokenizer(first)
            from generation.assets import load_tokenizer
            from retrieval.tokens import HFTextTokenizer

            return HFTextTokenizer(load_tokenizer(self.generator_dir), name=str(self.generator_dir))

    @cached_property
    def prompt_builder(self) -> PromptBuilder:
        """The :class:`app.prompting.prompt.PromptBuilder` for the generator's tokenizer and chat template.

        Raises:
            InvalidConfig: no usable chat template (see :mod:`generation.chat_template`).
        """
        from app.prompting.prompt import PromptBuilder

        with self._lock:
            return PromptBuilder.for_tokenizer(self.tokenizer, self.settings.chat_template)

    # --- embedder, index, retriever -------------------------------------------------
    @cached_property
    def embedder(self) -> Embedder:
        """The configured embedder on its backend (``retrieval.embedding_runtime.build_embedder``).

        The onnx/openvino backends export the model once, offline, under
        ``embedder_export_dir`` (default ``<data_dir>/models``) on first use.

        Raises:
            InvalidConfig: unknown backend, int8 on a backend without it, or a bad model path.
        """
        from retrieval.embedding import packaged_embedder_path
        from retrieval.embedding_runtime import build_embedder, default_batch_size, resolve_quantization

        with self._lock:
            s = self.settings
            path = s.embedder_path or str(packaged_embedder_path())
            return build_embedder(s.embedder_backend, path,
                                  export_root=s.embedder_export_dir or self.data_dir / "models",
                                  batch_size=s.embed_batch_size or default_batch_size(s.embedder_backend),
                                  threads=s.torch_threads,
                                  quantization=resolve_quantization(s.embedder_backend,
                                                                    s.embedder_quantization))

    @cached_property
    def retriever(self) -> RetrieverProtocol:
        """The version-pinned retriever over the FAISS index in ``<data_dir>/index``."""
        from retrieval.retriever import Retriever

        with self._lock:
            return Retriever(self.engine, self.embedder, self.data_dir / "index")

    def _remote_tokenizer(self, cfg: EngineConfig) -> TextTokenizer:
        """A remote engine's tokenizer: its own ``tokenizer``, else the ``remote_tokenizer``
        setting, else its model name (:func:`generation.remote_tokenizer.load_remote_tokenizer`)."""
        from generation.remote_tokenizer import load_remote_tokenizer

        return load_remote_tokenizer(cfg.tokenizer or self.settings.remote_tokenizer or cfg.model,
                                     self.settings.data_dir)

    # --- generation -----------------------------------------------------------------
    @cached_property
    def generator(self) -> Generator:
        """The first configured engine's generator (local transformers model or remote engine),
        loaded once; with no engine list, the one engine of ``generator_backend``."""
        with self._lock:
            return build_generator(self.settings, self)

    @property
    def engine_ids(self) -> list[str]:
        """The configured engines' ids, in order (``['default']`` without an engine list)."""
        return [e.id for e in self.settings.engine_list()]

    def engine_generator(self, engine_id: str) -> Generator:
        """The generator of the configured engine ``engine_id``, built once per process.

        The first engine's is :attr:`generator`. Every other engine must tokenize as the first
        does (the prompt is built once, as token ids, before an engine is chosen).

        Raises:
            NotFound: ``unknown_engine``, no configured engine has that id.
            InvalidConfig: the engine cannot be built, or its tokenizer differs from the first's.
        """
        engines = self.settings.engine_list()
        ids = [e.id for e in engines]
        if engine_id not in ids:
            raise NotFound(f"engine {engine_id!r} is not configured (engines: {', '.join(ids)})",
                           code="unknown_engine", engine_id=engine_id, engines=ids)
        if engine_id == ids[0]:
            return self.generator
        with self._lock:
            built: dict[str, Generator] = self.__dict__.setdefault("_engine_generators", {})
            if engine_id not in built:
                cfg = engines[ids.index(engine_id)]
                tokenizer = self.tokenizer
                source = cfg.tokenizer or self.settings.remote_tokenizer or cfg.model
                first = engines[0].tokenizer or self.settings.remote_tokenizer or engines[0].model
                if cfg.kind == "remote" and (engines[0].kind == "local" or source != first):
                    own = self._remote_tokenizer(cfg)
                    if own.tokenizer_id != tokenizer.tokenizer_id:
                        raise InvalidConfig(
                            f"engine {engine_id!r} tokenizes with {own.tokenizer_id}, engine "
                            f"{ids[0]!r} with {tokenizer.tokenizer_id}: every engine of a list must "
                            "share one tokenizer", engine_id=engine_id)
                built[engine_id] = build_generator(self.settings, self, cfg)
            return built[engine_id]

    def prefix_cache_stats(self) -> dict[str, PrefixCacheStats]:
        """Engine id -> its prefix KV cache's counters now, for each engine whose generator is
        already built and keeps one (the local engine's
        :class:`generation.engine.kv_cache.BlockPrefixCache`; a remote engine's cache is its
        server's). Builds nothing: an engine not loaded yet has no entry."""
        from generation.engine.kv_cache import BlockPrefixCache

        built: dict[str, Generator] = dict(self.__dict__.get("_engine_generators", {}))
        if "generator" in self.__dict__:
            built[self.engine_ids[0]] = self.__dict__["generator"]
        out: dict[str, PrefixCacheStats] = {}
        for engine_id, gen in built.items():
            cache = gen.prefix_cache if isinstance(gen, SupportsPrefixCache) else None
            if isinstance(cache, BlockPrefixCache):
                out[engine_id] = cache.stats()
        return out

    def close(self) -> None:
        """Release the database pool."""
        if "engine" in self.__dict__:
            self.engine.dispose()


def build_generator(settings: Settings, services: Services, engine: EngineConfig | None = None) -> Generator:
    """Build the generator of ``engine`` (default: the first of ``settings.engine_list()``).

    ``local``: the model in ``services.generator_dir`` (the packaged SmolLM2 unless
    ``generator_path`` is set), sharing ``services.tokenizer``. ``remote``: an
    OpenAI-compatible server at the engine's ``base_url`` serving its ``model`` (without an
    engine list: ``remote_base_url`` and ``remote_model``). Either way
    the chat template is resolved first (a model that cannot be framed is refused before
    any weights load), its end-of-turn token ends answers besides the model's EOS set,
    and its identity is part of ``generator.identity["chat_template"]``.

    Raises:
        InvalidConfig: remote backend without base URL or model, an unloadable model, or
            no usable chat template.
    """
    cfg = engine if engine is not None else settings.engine_list()[0]
    builder = services.prompt_builder
    stop_ids = list(builder.end_of_turn_ids)
    gen: Generator
    if cfg.kind == "remote":
        from generation.remote import RemoteGenerator

        if not cfg.base_url or not cfg.model:
            raise InvalidConfig("generator_backend=remote needs remote_base_url and remote_model")
        gen = RemoteGenerator(cfg.base_url, cfg.model,
                              tokenizer=services.tokenizer, api_key=cfg.api_key,
                              tokenizer_source=cfg.tokenizer or settings.remote_tokenizer,
                              context_window=cfg.context_window, stop_token_ids=stop_ids,
                              max_running=cfg.max_running)
    else:
        from generation.assets import PACKAGED_GENERATOR_ID
        from generation.local import LocalGenerator

        model_id = settings.generator_path or PACKAGED_GENERATOR_ID
        gen = LocalGenerator(services.generator_dir, tokenizer=services.tokenizer, model_id=model_id,
                             device=settings.generator_device, dtype=settings.generator_dtype,
                             threads=settings.torch_threads, stop_token_ids=stop_ids,
                             max_running=settings.generator_max_running,
                             step_token_budget=settings.generator_step_token_budget,
                             prefill_chunk=settings.generator_prefill_chunk,
                             prefix_cache_mib=settings.generator_prefix_cache_mib,
                             precision=settings.generator_precision,
                             tile_rows=settings.generator_tile_rows,
                             warm_turns=settings.generator_warm_turns,
                             turn_close_ids=builder.turn_close_ids)
    gen.identity["chat_template"] = builder.describe()
    return gen
