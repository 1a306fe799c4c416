"""build_generator picks and configures the backend from settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.services import Services, build_generator
from app.settings import get_settings
from foundation.errors import InvalidConfig
from generation import Generator
from generation.remote import RemoteGenerator
from tests.generation.fake_openai import FakeOpenAI


def test_remote_backend_without_url_or_model_is_a_config_error(tmp_path: Path) -> None:
    settings = get_settings(data_dir=tmp_path, generator_backend="remote", remote_tokenizer="cl100k_base")
    with pytest.raises(InvalidConfig):
        build_generator(settings, Services(settings))


def test_remote_backend_uses_the_services_tokenizer(tmp_path: Path) -> None:
    with FakeOpenAI(["x"]) as server:
        settings = get_settings(data_dir=tmp_path, generator_backend="remote",
                                remote_base_url=server.base_url, remote_model="fake-model",
                                remote_tokenizer="cl100k_base")
        services = Services(settings)
        gen = services.generator
        assert isinstance(gen, RemoteGenerator) and isinstance(gen, Generator)
        assert gen.tokenizer is services.tokenizer
        assert gen.identity["model_id"] == "fake-model" and gen.context_window == 2048


def test_unknown_remote_tokenizer_name_is_a_config_error(tmp_path: Path) -> None:
    settings = get_settings(data_dir=tmp_path, generator_backend="remote", remote_model="no-such-model")
    with pytest.raises(InvalidConfig):
        Services(settings).tokenizer  # noqa: B018


@pytest.mark.slow
def test_local_backend_loads_the_configured_directory_once(tmp_path: Path, smollm_dir: Path) -> None:
    settings = get_settings(data_dir=tmp_path, generator_path=str(smollm_dir), torch_threads=1)
    services = Services(settings)
    gen = services.generator
    assert services.generator is gen and gen.tokenizer is services.tokenizer
    assert gen.identity["model_id"] == str(smollm_dir) and gen.identity["device"] == "cpu"
