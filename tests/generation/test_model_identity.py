"""A model is known by its content: a GGUF replaced in place with the same size, modification
time and inode is converted again, and the identity receipts record names the new weights."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from generation.assets import (
    converted_gguf_dir,
    converted_source,
    generator_dir,
    gguf_sha256,
    packaged_gguf_path,
    weights_hash,
)

TENSOR = "blk.0.attn_norm.weight"  # F32 in the packaged GGUF; model.layers.0.input_layernorm.weight in HF
HF_TENSOR = "model.layers.0.input_layernorm.weight"


def _rewrite_in_place_keeping_size_and_mtime(gguf: Path) -> None:
    """Double one F32 norm vector inside the file, as ``cp -p``/``rsync -a`` of another model
    would leave it: same size, same mtime (restored with ``os.utime``), same inode."""
    from gguf import GGUFReader

    before = gguf.stat()
    tensor = next(t for t in GGUFReader(str(gguf)).tensors if t.name == TENSOR)
    with gguf.open("r+b") as f:
        f.seek(tensor.data_offset)
        values = np.frombuffer(f.read(int(tensor.n_bytes)), dtype=np.float32) * 2.0
        f.seek(tensor.data_offset)
        f.write(values.astype(np.float32).tobytes())
    os.utime(gguf, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = gguf.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns,
                                                                before.st_ino)


def _norm(model_dir: Path) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        return f.get_tensor(HF_TENSOR)


@pytest.fixture
def own_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "incoming" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.parent.mkdir()
    shutil.copy2(packaged_gguf_path(), path)  # cp -p
    return path


def test_a_gguf_replaced_with_the_same_size_and_mtime_is_converted_again(own_gguf: Path,
                                                                         tmp_path: Path) -> None:
    from generation.local import LocalGenerator

    data = tmp_path / "data"
    first_dir = generator_dir(data, str(own_gguf))
    first_hash, first_source = weights_hash(first_dir), gguf_sha256(own_gguf)
    assert converted_source(first_dir) == first_source

    _rewrite_in_place_keeping_size_and_mtime(own_gguf)
    second_dir = generator_dir(data, str(own_gguf))

    assert gguf_sha256(own_gguf) != first_source
    assert second_dir != first_dir and converted_source(second_dir) == gguf_sha256(own_gguf)
    np.testing.assert_array_equal(_norm(second_dir), 2.0 * _norm(first_dir))  # the new weights
    identity = LocalGenerator(second_dir, device="cpu", dtype="float32", threads=1).identity
    assert identity["weights_hash"] == weights_hash(second_dir) != first_hash  # what receipts record


def test_a_converted_copy_is_reused_only_for_the_content_it_was_made_from(own_gguf: Path,
                                                                          tmp_path: Path) -> None:
    digest = gguf_sha256(own_gguf)
    target = converted_gguf_dir(tmp_path / "data", own_gguf, digest)
    assert target.name == f"smollm2-135m-instruct.q4_1-{digest[7:19]}-fp32"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"")
    assert converted_source(target) is None  # no SOURCE: an older conversion, not reusable
    (target / "SOURCE").write_text(f"{own_gguf.name}\n{digest}\n")
    assert converted_source(target) == digest
    _rewrite_in_place_keeping_size_and_mtime(own_gguf)
    assert converted_gguf_dir(tmp_path / "data", own_gguf) != target
