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
