"""The embedder backend settings: validated at settings time, built by Services on its backend."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from app.services import Services
from app.settings import get_settings
from foundation.errors import InvalidConfig

EXPORT_ROOT = Path(__file__).resolve().parents[2] / "ragbudget-data" / "models"


@pytest.mark.parametrize(("field", "value"), [("embedder_backend", "tensorflow"),
                                              ("embedder_quantization", "int4")])
def test_unknown_backend_or_quantization_is_refused_by_the_settings(field: str, value: str,
                                                                   tmp_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError):
        get_settings(data_dir=tmp_path, **{field: value})


def test_int8_on_openvino_is_invalid_config_and_exports_nothing(tmp_path: Path) -> None:
    services = Services(get_settings(data_dir=tmp_path / "data", embedder_backend="openvino",
                                     embedder_quantization="int8"))
    with pytest.raises(InvalidConfig, match="onnx backend only"):
        services.embedder  # noqa: B018
    assert not (tmp_path / "data" / "models").exists()


@pytest.mark.slow
def test_services_build_the_configured_backend_with_its_export_dir(tmp_path: Path) -> None:
    settings = get_settings(data_dir=tmp_path / "data", embedder_backend="onnx",
                            embedder_quantization="none", embedder_export_dir=EXPORT_ROOT)
    embedder = Services(settings).embedder
    assert embedder.identity["backend"] == "onnx" and embedder.identity["quantization"] == "none"
    assert EXPORT_ROOT in embedder.graph.parents and not (tmp_path / "data" / "models").exists()


@pytest.mark.slow
def test_the_default_embedder_is_onnx_int8_one_text_per_pass(tmp_path: Path) -> None:
    embedder = Services(get_settings(data_dir=tmp_path / "data", embedder_export_dir=EXPORT_ROOT)).embedder
    assert (embedder.identity["backend"], embedder.identity["quantization"]) == ("onnx", "int8-dynamic")
    assert embedder.identity["batch_size"] == 1


def test_torch_keeps_its_batch_of_32_and_no_quantization(tmp_path: Path) -> None:
    embedder = Services(get_settings(data_dir=tmp_path / "data", embedder_backend="torch")).embedder
    assert embedder.identity["batch_size"] == 32 and embedder.identity.get("quantization", "none") == "none"


def test_auto_quantization_resolves_per_backend() -> None:
    from retrieval.embedding_runtime import resolve_quantization

    resolved = [resolve_quantization(b, "auto") for b in ("torch", "onnx", "openvino")]
    assert resolved == ["none", "int8", "none"]
    assert resolve_quantization("onnx", "none") == "none"
    with pytest.raises(InvalidConfig):
        resolve_quantization("onnx", "int4")
