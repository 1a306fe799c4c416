"""The local engine's compute precision (generation.precision): refusal, identity, and bits.

* ``bf16`` is refused at start on a CPU without ``avx512_bf16``/``amx_bf16`` and off the CPU.
* The precision is named in the profile key, so fp32 and bf16 are calibrated apart.
* The tiled bf16 linear gives every row the same bits whether it is computed alone or inside
  a larger batch, at any place, for ``M`` = 1..300, on each of SmolLM2-135M's linear shapes.
* An answer's logits (prefill and decode) DO depend on the prefill chunk size, in both
  precisions (the fp32 attention kernel; an expected failure, not strict: the kernel's split is
  the CPU's).

Tests that run bf16 kernels skip on a CPU without the flags (they would be refused).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from foundation.errors import InvalidConfig
from generation.precision import bf16_supported, check_precision, precision_label
from latency_model.profile import profile_dtype

needs_bf16 = pytest.mark.skipif(not bf16_supported(),
                                reason="CPU lacks avx512_bf16 and amx_bf16 (/proc/cpuinfo flags)")

#: (name, K in, N out) of SmolLM2-135M's linear layers (benchmarks/precision.py).
SHAPES = [("q/o", 576, 576), ("k/v", 576, 192), ("gate/up", 576, 1536), ("down", 1536, 576),
          ("lm_head", 576, 49152)]


def test_bf16_is_refused_on_a_cpu_without_bf16_instructions() -> None:
    with pytest.raises(InvalidConfig, match="avx512_bf16 or amx_bf16"):
        check_precision("bf16", "cpu", "float32", flags={"avx512f", "avx512_vnni"})
    check_precision("bf16", "cpu", "float32", flags={"amx_bf16"})  # either flag suffices
    check_precision("bf16", "cpu", "float32", flags={"avx512_bf16"})


def test_bf16_is_refused_off_the_cpu_or_on_a_non_fp32_model_and_unknown_names_are_refused() -> None:
    with pytest.raises(InvalidConfig, match="generator_dtype=bfloat16"):
        check_precision("bf16", "cuda", "bfloat16", flags={"amx_bf16"})
    with pytest.raises(InvalidConfig, match="must be float32"):
        check_precision("bf16", "cpu", "bfloat16", flags={"amx_bf16"})
    with pytest.raises(InvalidConfig, match="unknown generator precision"):
        check_precision("int4", "cpu", "float32")
    check_precision("fp32", "cuda", "bfloat16", flags=set())  # fp32 needs nothing


def test_the_profile_key_names_the_precision_and_keeps_fp32_keys_unchanged() -> None:
    base = {"dtype": "float32", "device": "cpu"}
    assert profile_dtype(base) == "float32"  # identities written before precisions existed
    assert profile_dtype({**base, "precision": precision_label("fp32")}) == "float32"
    assert profile_dtype({**base, "precision": precision_label("bf16", 128)}) == "float32/bf16-tile128"


@needs_bf16
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_tiled_bf16_rows_have_the_same_bits_alone_and_in_any_batch(shape: tuple[str, int, int]) -> None:
    import torch

    from foundation.compute import torch_threads
    from generation.tiled_linear import TiledBF16Linear

    _, k, n = shape
    g = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    op = TiledBF16Linear(lin, 128)
    x = torch.randn(300, k, generator=g)  # (300, K) fp32
    with torch_threads(2), torch.inference_mode():
        ref = op(x)  # (300, N): every row inside a 300-row batch
        differ = [m for m in range(1, 301)
                  if not torch.equal(op(x[:m]), ref[:m]) or not torch.equal(op(x[300 - m:]), ref[300 - m:])]
        alone = [i for i in (0, 1, 127, 128, 299) if not torch.equal(op(x[i:i + 1]), ref[i:i + 1])]
    assert differ == [] and alone == [], f"row counts {differ} / rows alone {alone} changed bits"
    assert ref.dtype == torch.float32 and ref.shape == (300, n)


@pytest.fixture(scope="module", params=[pytest.param("fp32", marks=pytest.mark.slow),
                                        pytest.param("bf16", marks=[pytest.mark.slow, needs_bf16])])
def gen(request: pytest.FixtureRequest, smollm_dir: Path, smollm_tokenizer: Any) -> Iterator[Any]:
    import torch

    from generation.local import LocalGenerator

    before = torch.get_num_threads()
    yield LocalGenerator(smollm_dir, tokenizer=smollm_tokenizer, device="cpu", threads=2,
                         precision=request.param)
    torch.set_num_threads(before)


def _logits(gen: Any, ids: list[int], chunk: int, decode_steps: int = 3) -> list[Any]:
    """Every logits row the answer's sampler saw (first token, then ``decode_steps`` more),
    with the prompt prefilled in chunks of ``chunk`` tokens and a cold prefix cache."""
    from foundation.compute import call
    from generation.base import GenParams

    seen: list[Any] = []
    seq = gen._sequence(ids, 0, GenParams(max_new_tokens=decode_steps + 1), chunk=chunk, eos=frozenset())
    inner = seq.select
    seq.select = lambda row: (seen.append(row.clone()), inner(row))[1]

    def run() -> None:
        with gen._lock:
            gen.prefix_cache.clear()
            gen.engine.run_alone(seq, decode_steps=decode_steps)
    call(run)
    return seen


@pytest.mark.xfail(strict=False, reason="attention is fp32 in both precisions and torch's CPU "
                   "scaled_dot_product_attention blocks its work by the query length, so a chunk's "
                   "rows get other bits at another chunk size (measured 2026-12-05: fp32 from chunk 64, "
                   "bf16 from chunk 100, prompt of 300); the engine records prefill_chunk in every "
                   "receipt and replay reuses it (docs/receipts.md). Not strict: where the split "
                   "depends on the CPU model, another machine may pass.")
def test_logits_do_not_depend_on_the_prefill_chunk_size(gen: Any) -> None:
    import torch

    ids = gen._synthetic_ids(300)
    want = _logits(gen, ids, 300)  # one chunk
    assert len(want) == 4
    for chunk in (32, 64, 100, 256):
        got = _logits(gen, ids, chunk)
        same = [torch.equal(a, b) for a, b in zip(got, want, strict=True)]
        assert all(same), f"{gen.precision}: chunk {chunk} changed logits rows {same}"


def test_identity_names_the_precision_everywhere_it_is_keyed(gen: Any) -> None:
    assert gen.identity["precision"] == gen.precision == gen.identity["engine"]["precision"]
    assert gen.precision in ("fp32", "bf16-tile128")
    root = gen.model_id + "@" + gen.identity["weights_hash"]
    assert gen.prefix_cache.model_id == (root if gen.precision == "fp32" else f"{root}/{gen.precision}")
