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
                                remote_tokenizer="cl100k_base", chat_template="plain")
        services = Services(settings)
        gen = services.generator
        assert isinstance(gen, RemoteGenerator) and isinstance(gen, Generator)
        assert gen.tokenizer is services.tokenizer
        assert gen.identity["model_id"] == "fake-model" and gen.context_window == 2048
        assert gen.identity["chat_template"]["origin"] == "plain"


def test_a_model_that_cannot_be_framed_is_refused_before_any_request(tmp_path: Path) -> None:
    with FakeOpenAI(["x"]) as server:
        settings = get_settings(data_dir=tmp_path, generator_backend="remote",
                                remote_base_url=server.base_url, remote_model="fake-model",
                                remote_tokenizer="cl100k_base")
        with pytest.raises(InvalidConfig) as err:
            Services(settings).generator  # noqa: B018
        assert err.value.code == "no_chat_template" and server.requests == []


def test_the_server_context_window_setting_wins(tmp_path: Path) -> None:
    with FakeOpenAI(["x"]) as server:
        settings = get_settings(data_dir=tmp_path, generator_backend="remote",
                                remote_base_url=server.base_url, remote_model="fake-model",
                                remote_tokenizer="cl100k_base", chat_template="plain",
                                remote_context_window=8192)
        assert Services(settings).generator.context_window == 8192


@pytest.mark.parametrize("name", ["model.gguf", "dir"])
def test_a_generator_path_that_is_neither_a_gguf_nor_a_model_directory_is_refused(
        tmp_path: Path, name: str) -> None:
    from generation.assets import generator_dir

    path = tmp_path / name
    if name.endswith(".gguf"):
        path.write_bytes(b"not a gguf file")
    else:
        path.mkdir()
    with pytest.raises(InvalidConfig, match="GGUF|config.json"):
        generator_dir(tmp_path / "data", str(path))
    assert not (tmp_path / "data" / "models").exists()


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
