"""Fixtures for generation tests: the packaged SmolLM2 (converted once, shared) and its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The fp32 copy of the packaged SmolLM2-135M-Instruct (converted on first use)."""
    from generation.assets import ensure_packaged_generator

    return ensure_packaged_generator(REPO / "ragbudget-data")


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_dir: Path) -> Any:
    """The product's generation tokenizer (special-token strings stay plain text)."""
    from generation.assets import load_tokenizer
    from retrieval.tokens import HFTextTokenizer

    return HFTextTokenizer(load_tokenizer(smollm_dir), name=str(smollm_dir))


@pytest.fixture(scope="session")
def local_generator(smollm_dir: Path, smollm_tokenizer: Any) -> Any:
    """One loaded SmolLM2 on CPU fp32 for the whole session (tests keep max_new_tokens small)."""
    from generation.local import LocalGenerator

    return LocalGenerator(smollm_dir, tokenizer=smollm_tokenizer, device="cpu", dtype="float32", threads=1)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF (a base model without a chat template), assembled once."""
    from generation.assets import packaged_gemma3_gguf

    return packaged_gemma3_gguf(REPO / "ragbudget-data")


@pytest.fixture(scope="session")
def gemma_dir(gemma_gguf: Path) -> Path:
    """Its fp32 Hugging Face copy, converted once through the generator_path route."""
    from generation.assets import generator_dir

    return generator_dir(REPO / "ragbudget-data", str(gemma_gguf))


@pytest.fixture(scope="session")
def gemma_tokenizer(gemma_dir: Path) -> Any:
    from generation.assets import load_tokenizer
    from retrieval.tokens import HFTextTokenizer

    return HFTextTokenizer(load_tokenizer(gemma_dir), name=str(gemma_dir))
