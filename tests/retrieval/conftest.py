"""Fixtures for retrieval tests: a fake embedder, a fixture corpus writer and a retriever."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Engine

from retrieval.retriever import Retriever
from tests.retrieval.corpus import FixtureCorpus
from tests.retrieval.fakes import HashingEmbedder


@pytest.fixture
def fake_embedder() -> HashingEmbedder:
    return HashingEmbedder()


@pytest.fixture
def corpus(engine: Engine, fake_embedder: HashingEmbedder) -> FixtureCorpus:
    """Writes revisions to the database under test, embedding chunks like ingest does."""
    return FixtureCorpus(engine, fake_embedder)


@pytest.fixture
def index_dir(tmp_path: Path) -> Path:
    return tmp_path / "index"


@pytest.fixture
def retriever(engine: Engine, fake_embedder: HashingEmbedder, index_dir: Path) -> Retriever:
    return Retriever(engine, fake_embedder, index_dir)
