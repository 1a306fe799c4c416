"""The services container: everything heavy is loaded once per process, lazily, thread-safely.

The CLI and the API both hold one :class:`Services`. Nothing is loaded at
import time; each property loads its object on first use and caches it.
"""

from __future__ import annotations

import threading
from functools import cached_property
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from app.settings import Settings


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
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        return self.settings.data_dir

    # --- tokenizer and chunking ---------------------------------------------------
    @cached_property
    def generator_dir(self) -> Path:
        """Local HF directory of the generator (the packaged model is converted once)."""
        from app.assets import generator_dir

        with self._lock:
            return generator_dir(self.data_dir, self.settings.generator_path)

    @cached_property
    def tokenizer(self) -> Any:
        """The generator's tokenizer as a ``retrieval.tokens.TextTokenizer``."""
        with self._lock:
            if self.settings.generator_backend == "remote":
                from app.generation.remote_tokenizer import load_remote_tokenizer

                return load_remote_tokenizer(self.settings)
            from app.assets import load_tokenizer
            from retrieval.tokens import HFTextTokenizer

            return HFTextTokenizer(load_tokenizer(self.generator_dir), name=str(self.generator_dir))

    # --- embedder, index, retriever -------------------------------------------------
    @cached_property
    def embedder(self) -> Any:
        """The configured sentence-transformers embedder (``retrieval.embedding``)."""
        from app.assets import packaged_embedder_path
        from retrieval.embedding import SentenceTransformerEmbedder

        with self._lock:
            path = self.settings.embedder_path or str(packaged_embedder_path())
            return SentenceTransformerEmbedder(
                path, batch_size=self.settings.embed_batch_size, threads=self.settings.torch_threads
            )

    @cached_property
    def retriever(self) -> Any:
        """The version-pinned retriever over the FAISS index in ``<data_dir>/index``."""
        from retrieval.retriever import Retriever

        with self._lock:
            return Retriever(self.engine, self.embedder, self.data_dir / "index")

    # --- generation -----------------------------------------------------------------
    @cached_property
    def generator(self) -> Any:
        """The configured generator (local transformers model or remote engine), loaded once."""
        from app.generation import load_generator

        with self._lock:
            return load_generator(self.settings, self)

    def close(self) -> None:
        """Release the database pool."""
        if "engine" in self.__dict__:
            self.engine.dispose()
