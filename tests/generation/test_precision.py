"""The local engine's compute precision (generation.precision): refusal, identity, and bits.

* ``bf16`` is refused at start on a CPU without ``avx512_bf16``/``amx_bf16`` and off the CPU.
* The precision is named in the profile key, so fp32 and bf16 are calibrated apart.
* The tiled bf16 linear gives every row the same bits whether it is computed alone or inside
  a larger batch, at any place, for ``M`` = 1..300, on each of SmolLM2-135M's linear shapes.
* ``int8`` (w8a8): the int32 GEMM is the exact product; every row of an int8 linear, and of a
  whole MLP block (norm, gate/up, SiLU, down, residual), has the same bits for ``M`` = 1..300
  with no padding; and through the engine, an answer's logits row has the same bits alone and
  in unpadded steps of 1 to 8 answers plus prefill chunks (1 to 265 rows).
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
from generation.precision import bf16_supported, check_precision, int8_supported, precision_label
from latency_model.profile import profile_dtype

needs_bf16 = pytest.mark.skipif(not bf16_supported(),
                                reason="CPU lacks avx512_bf16 and amx_bf16 (/proc/cpuinfo flags)")
needs_int8 = pytest.mark.skipif(not int8_supported(),
                                reason="CPU lacks avx512_vnni, avx_vnni and amx_int8 (/proc/cpuinfo flags)")

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
    assert profile_dtype({**base, "precision": precision_label("int8", 128)}) == "float32/int8-w8a8"
    assert profile_dtype({**base, "precision": precision_label("int8a16", 128)}) == "float32/int8-w8a16"


def test_int8_is_refused_without_vnni_off_the_cpu_and_on_a_non_fp32_model() -> None:
    with pytest.raises(InvalidConfig, match="avx512_vnni or avx_vnni or amx_int8"):
        check_precision("int8", "cpu", "float32", flags={"avx512f", "avx512bw", "avx512_bf16"})
    with pytest.raises(InvalidConfig, match="generator_dtype=bfloat16"):
        check_precision("int8", "cuda", "bfloat16", flags={"avx512_vnni"})
    with pytest.raises(InvalidConfig, match="must be float32"):
        check_precision("int8", "cpu", "bfloat16", flags={"avx512_vnni"})
    for flag in ("avx512_vnni", "avx_vnni", "amx_int8"):  # any one suffices
        check_precision("int8", "cpu", "float32", flags={flag})


def test_int8_is_refused_where_the_int_mm_kernel_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from generation.precision import check_int8_kernel

    monkeypatch.delattr(torch, "_int_mm")
    with pytest.raises(InvalidConfig, match="torch._int_mm"):
        check_int8_kernel()


@needs_int8
def test_the_int8_kernel_is_exact_on_the_worst_case_sums() -> None:
    """Every int8 shape of the model, and rows of +-127 (the sums a saturating int16 path
    would clip): torch._int_mm equals the float64 product."""
    import torch

    from generation.precision import check_int8_kernel
    from generation.tiled_linear import QMAX

    check_int8_kernel()  # raises when not exact
    g = torch.Generator().manual_seed(3)
    for _, k, n in SHAPES:
        a = torch.randint(-QMAX, QMAX + 1, (33, k), dtype=torch.int8, generator=g)  # (33, K)
        b = torch.randint(-QMAX, QMAX + 1, (n, k), dtype=torch.int8, generator=g)  # (N, K)
        a[0].fill_(QMAX)
        b[:2].fill_(QMAX)
        b[1].neg_()
        got = torch._int_mm(a, b.t())  # (33, N) int32
        assert torch.equal(got.double(), a.double() @ b.double().t()), f"K={k} N={n} not exact"
        assert int(got[0, 0]) == k * QMAX * QMAX  # the largest sum, not saturated


def _rows_differ(op: Any, x: Any) -> tuple[list[int], list[int], Any]:
    """Row counts ``M`` in 1..len(x) where ``op(x[:M])`` or ``op(x[-M:])`` differs from the same
    rows of ``op(x)``; rows computed alone that differ; and ``op(x)``."""
    import torch

    from foundation.compute import torch_threads

    n = int(x.shape[0])
    with torch_threads(2), torch.inference_mode():
        ref = op(x)
        differ = [m for m in range(1, n + 1)
                  if not torch.equal(op(x[:m]), ref[:m]) or not torch.equal(op(x[n - m:]), ref[n - m:])]
        alone = [i for i in (0, 1, 15, 16, 127, 128, n - 1) if not torch.equal(op(x[i:i + 1]), ref[i:i + 1])]
    return differ, alone, ref


@needs_int8
@pytest.mark.parametrize("passes", [1, 2], ids=["w8a8", "w8a16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_int8_rows_have_the_same_bits_alone_and_in_any_batch_without_padding(
        shape: tuple[str, int, int], passes: int) -> None:
    import torch

    from generation.tiled_linear import Int8Linear

    _, k, n = shape
    g = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    op = Int8Linear(lin, passes)
    x = torch.randn(300, k, generator=g) * torch.rand(300, 1, generator=g) * 4  # rows of other scales
    differ, alone, ref = _rows_differ(op, x)
    assert differ == [] and alone == [], f"row counts {differ} / rows alone {alone} changed bits"
    assert ref.dtype == torch.float32 and ref.shape == (300, n)
    # and it is the quantised product it claims to be: close to fp32 (per-row error bound)
    exact = x @ lin.weight.detach().T  # (300, N)
    err = (ref - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)
    assert float(err.max()) < (0.05 if passes == 1 else 0.02), f"int8 relative error {float(err.max()):.3f}"


@needs_int8
@pytest.mark.parametrize("precision", ["int8", "int8a16"])
def test_a_whole_int8_mlp_block_has_the_same_bits_in_any_batch(precision: str) -> None:
    """SmolLM2's post-attention half of a layer (RMSNorm, gate/up, SiLU x up, down, residual)
    with int8 linears: the row-wise fp32 ops between the GEMMs keep rows independent too."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP, LlamaRMSNorm

    from generation.precision import apply_precision

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, rms_norm_eps=1e-5)
    torch.manual_seed(5)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.mlp = LlamaRMSNorm(576, eps=1e-5), LlamaMLP(cfg)

        def forward(self, x: Any) -> Any:
            return x + self.mlp(self.norm(x))

    block = Block().eval()
    assert apply_precision(block, precision) == 3
    x = torch.randn(300, 576) * 2
    differ, alone, _ = _rows_differ(block, x)
    assert differ == [] and alone == [], f"row counts {differ} / rows alone {alone} changed bits"


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
                                        pytest.param("bf16", marks=[pytest.mark.slow, needs_bf16]),
                                        pytest.param("int8", marks=[pytest.mark.slow, needs_int8])])
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
    assert gen.precision in ("fp32", "bf16-tile128", "int8-w8a8")
    root = gen.model_id + "@" + gen.identity["weights_hash"]
    assert gen.prefix_cache.model_id == (root if gen.precision == "fp32" else f"{root}/{gen.precision}")
    # int8 runs steps unpadded; the others keep the 16-row padding
    padding = gen.identity["engine"]["row_padding"]
    assert padding == ("none" if gen.precision == "int8-w8a8" else "min16x8")
    assert gen.engine.runner.pad is (gen.precision != "int8-w8a8")


def _step_logits(gen: Any, decode: list[tuple[int, int]], prefill: int) -> Any:
    """Logits of one engine step (unpadded in int8) of decode answers ``(context, token)`` and
    a prefill chunk of ``prefill`` tokens ending its prompt (0: none), through the runner;
    the answers' KV are zeroed stand-ins, the same for every call."""
    import torch

    from foundation.compute import call
    from generation.base import GenParams
    from generation.engine.kv_cache import SeqKV
    from generation.engine.scheduler import schedule

    c = gen.config
    kv_heads, head_dim = int(c.num_key_value_heads), int(c.hidden_size // c.num_attention_heads)

    def stand_in(length: int, pos: int, chunk: int) -> Any:
        seq = gen._sequence(gen._synthetic_ids(length), 0, GenParams(max_new_tokens=2),
                            chunk=chunk, eos=frozenset())
        seq.kv = SeqKV(length + 3)
        seq.kv.allocate(int(c.num_hidden_layers), kv_heads, head_dim, torch.float32, "cpu")
        seq.pos = pos
        return seq

    seqs = []
    for ctx, tok in decode:
        seq = stand_in(ctx, ctx, 1)
        seq.next_tok = tok
        seqs.append(seq)
    if prefill:
        seqs.append(stand_in(prefill, 0, prefill))

    def run() -> Any:
        with gen._lock:
            return gen.engine.runner.run(schedule(seqs, None), seqs)
    return call(run)


@pytest.mark.slow
@needs_int8
@pytest.mark.parametrize("precision", ["int8", "int8a16"])
def test_int8_engine_logits_rows_are_identical_alone_and_in_unpadded_steps(
        smollm_dir: Path, smollm_tokenizer: Any, precision: str) -> None:
    import torch

    from generation.local import LocalGenerator

    before = torch.get_num_threads()
    try:
        gen = LocalGenerator(smollm_dir, tokenizer=smollm_tokenizer, device="cpu", threads=2,
                             precision=precision)
        assert gen.identity["engine"]["row_padding"] == "none"
        answers = [(100 + 37 * i, 1000 + 611 * i) for i in range(8)]  # (context, next token)
        alone = [_step_logits(gen, [a], 0)[0] for a in answers]  # (vocab,) each, a 1-row step
        prefill_alone = _step_logits(gen, [], 57)[-1]
        for n in range(2, 9):
            for prefill in (0, 1, 57, 200, 257 - n):
                got = _step_logits(gen, answers[:n], prefill)  # (n [+1], vocab)
                same = [torch.equal(got[i], alone[i]) for i in range(n)]
                assert all(same), f"{n} answers + prefill {prefill}: rows {same}"
                if prefill == 57:
                    assert torch.equal(got[n], prefill_alone), f"prefill row, {n} decode mates"
    finally:
        torch.set_num_threads(before)
