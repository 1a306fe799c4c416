"""Store fixtures: the generator's real tokenizer (converted once), the embedder's word-piece
counter, a chunker config, and a small ``ingest`` helper bound to the engine under test."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from retrieval.chunking import ChunkerConfig, wordpiece_counter
from retrieval.tokens import HFTextTokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def generator_dir() -> Path:
    """The fp32 SmolLM2 directory (converted from the packaged GGUF once per data dir)."""
    from generation.assets import ensure_packaged_generator

    data_dir = Path(os.environ.get("RAGBUDGET_TEST_MODEL_DATA_DIR", REPO / "ragbudget-data"))
    return ensure_packaged_generator(data_dir)


@pytest.fixture(scope="session")
def tokenizer(generator_dir: Path) -> HFTextTokenizer:
    from generation.assets import load_tokenizer

    return HFTextTokenizer(load_tokenizer(generator_dir), name="smollm2-135m-instruct")


@pytest.fixture(scope="session")
def embed_count() -> Callable[[str], int]:
    from retrieval.embedding import packaged_embedder_path

    return wordpiece_counter(packaged_embedder_path())


@pytest.fixture
def config() -> ChunkerConfig:
    return ChunkerConfig(chunk_tokens=64, overlap_tokens=8)


@pytest.fixture
def ingest(engine, tokenizer, config, embed_count):  # type: ignore[no-untyped-def]
    """``ingest(items, delete_ids=(), **kw) -> IngestReport`` on the engine under test."""
    from retrieval.store import ingest_batch

    def run(items, delete_ids=(), **kw):  # type: ignore[no-untyped-def]
        kw.setdefault("chunker_config", config)
        kw.setdefault("embed_token_count", embed_count)
        return ingest_batch(engine, items, tokenizer=tokenizer, delete_ids=delete_ids, **kw)

    return run


@pytest.fixture
def store_settings(tmp_path: Path, db_url: str, generator_dir: Path):  # type: ignore[no-untyped-def]
    """Settings for CLI/API tests: tmp data dir, the database under test, the converted generator."""
    from app.settings import get_settings

    return get_settings(data_dir=tmp_path / "data", database_url=db_url, auth_enabled=False,
                        generator_path=str(generator_dir), chunk_tokens=64, chunk_overlap_tokens=8)


@pytest.fixture
def services_factory(tokenizer, monkeypatch):  # type: ignore[no-untyped-def]
    """``make(settings) -> Services`` with the session tokenizer preloaded and no embedder."""
    from app.ingest import IngestService
    from app.services import Services

    monkeypatch.setattr(IngestService, "embedder", lambda self, embed=True: (None, None))
    made = []

    def make(settings):  # type: ignore[no-untyped-def]
        services = Services(settings)
        services.__dict__["tokenizer"] = tokenizer
        made.append(services)
        return services

    yield make
    for s in made:
        s.close()


@pytest.fixture
def cli_env(store_settings, tokenizer, monkeypatch):  # type: ignore[no-untyped-def]
    """The ``ragbudget`` CLI run in process points at the database under test: its settings as
    ``RAGBUDGET_*`` environment variables, and the session's tokenizer in the services."""
    from app.services import Services

    s = store_settings
    for key, value in {"DATA_DIR": s.data_dir, "DATABASE_URL": s.database_url, "AUTH_ENABLED": "false",
                       "GENERATOR_PATH": s.generator_path, "CHUNK_TOKENS": s.chunk_tokens,
                       "CHUNK_OVERLAP_TOKENS": s.chunk_overlap_tokens}.items():
        monkeypatch.setenv(f"RAGBUDGET_{key}", str(value))
    monkeypatch.setattr(Services, "tokenizer", property(lambda self: tokenizer))
