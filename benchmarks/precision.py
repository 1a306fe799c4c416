"""GEMM speed and batch/chunk invariance of the engine's linear shapes in fp32 and bf16 on CPU.

For each linear shape of the packaged SmolLM2-135M (``x (M, K) @ W.T`` with ``W (N, K)``:
q/o 576x576, k/v 576x192, gate/up 576x1536, down 1536x576, LM head 576x49152) and each
precision:

* ``fp32``: ``F.linear`` on fp32 weights and activations (MKL sgemm; the engine today);
* ``bf16``: ``F.linear`` on bf16 weights and bf16 activations (oneDNN, AVX512-BF16/AMX);
* ``bf16tileT``: bf16 as above, always in GEMMs of exactly ``T`` rows (the rows cut in
  tiles of ``T``, the last one zero-padded), so every call has one shape;
* ``autocast``: fp32 weights under ``torch.autocast("cpu", torch.bfloat16)`` (each call
  casts the weight to bf16 first);

it prints the median time (ms) and GFLOP/s (``2*M*K*N`` flops) at row counts ``--rows``,
then where result bits change with the row count: row ``i`` of ``x[o:o+M]`` computed in a
product of ``M`` rows at row offset ``o`` against the same row of one ``--ref-rows``-row
product (the engine pads steps to ``padded_rows``: a multiple of 8, at least 16). It also
checks the attention kernel (``F.scaled_dot_product_attention``, causal mask, 9 heads over
3 KV heads, head_dim 64) when a prefill of ``--ref-rows`` positions is split in chunks of
64 and 256 query rows over the same KV: the rows of each chunk against the one-shot rows.

    flock /tmp/ragbudget-cpu.lock .venv/bin/python -m benchmarks.precision --threads 2
    flock /tmp/ragbudget-cpu.lock .venv/bin/python -m benchmarks.precision --engine --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.common import machine_line

#: (name, K in, N out) of SmolLM2-135M's linear layers (config: hidden 576, intermediate 1536,
#: 9 heads x 64, 3 KV heads x 64, vocab 49152).
SHAPES = [("q/o", 576, 576), ("k/v", 576, 192), ("gate/up", 576, 1536), ("down", 1536, 576),
          ("lm_head", 576, 49152)]


def _time_ms(fn: Any, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(out)


def _ops(precision: str, w32: Any) -> Any:
    """A ``fn(x32) -> (M, N)`` for one precision over the fp32 weight ``w32`` (N, K)."""
    import torch
    import torch.nn.functional as F

    if precision == "fp32":
        return lambda x: F.linear(x, w32)
    if precision == "bf16":
        wb = w32.to(torch.bfloat16)
        return lambda x: F.linear(x.to(torch.bfloat16), wb)
    if precision.startswith("bf16tile"):  # bf16 in fixed tiles of T rows (the last one zero-padded)
        wb, t = w32.to(torch.bfloat16), int(precision[len("bf16tile"):])

        def tiled(x: Any) -> Any:
            m = int(x.shape[0])
            xp = torch.zeros((-(-m // t) * t, int(x.shape[1])), dtype=torch.bfloat16)
            xp[:m] = x
            return torch.cat([F.linear(xp[i:i + t], wb) for i in range(0, xp.shape[0], t)])[:m]
        return tiled

    def auto(x: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(x, w32)
    return auto


def differing_rows(op: Any, x: Any, ref: Any, max_m: int, offsets: list[int]) -> list[int]:
    """Row counts ``M`` in ``1..max_m`` where some row of ``op(x[o:o+M])`` differs from ``ref[o:o+M]``
    at any of ``offsets``."""
    import torch

    bad = []
    for m in range(1, max_m + 1):
        if any(not torch.equal(op(x[o:o + m]), ref[o:o + m]) for o in offsets if o + m <= x.shape[0]):
            bad.append(m)
    return bad


def _ranges(ms: list[int]) -> str:
    if not ms:
        return "none"
    out, start, prev = [], ms[0], ms[0]
    for m in ms[1:] + [-1]:
        if m != prev + 1:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = m
        prev = m
    return ",".join(out)


def attention_split(dtype: Any, n: int, chunks: list[int]) -> dict[int, bool]:
    """For each chunk size: are the chunked-prefill attention rows bit-identical to one shot?"""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, n, 64, generator=g).to(dtype)
    k = torch.randn(1, 3, n, 64, generator=g).to(dtype)
    v = torch.randn(1, 3, n, 64, generator=g).to(dtype)
    pos = torch.arange(n)
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=pos[None, :] <= pos[:, None], enable_gqa=True)
    same = {}
    for c in chunks:
        ok = True
        for s in range(0, n, c):
            e = min(n, s + c)
            mask = pos[None, :e] <= pos[s:e, None]
            o = F.scaled_dot_product_attention(q[:, :, s:e].contiguous(), k[:, :, :e], v[:, :, :e],
                                               attn_mask=mask if e - s > 1 else None, enable_gqa=True)
            ok = ok and torch.equal(o, full[:, :, s:e])
        same[c] = ok
    return same


def engine_timing(threads: int, rounds: int, prompts: list[int], contexts: list[int]) -> dict[str, Any]:
    """The local engine in fp32 and bf16, same process, interleaved round by round.

    Per precision: prefill of one answer alone, cold (``prefill_ms(n, 0)``, ms) for each
    ``n`` in ``prompts``, and one decode step (TPOT, ms) of 1 and 4 answers at each context
    in ``contexts`` (``step_ms(0, 0, [c] * answers)``). Medians over ``rounds``; each round
    times every cell once, the precisions alternating, so both see the same machine.
    """
    from benchmarks.common import REPO
    from generation.assets import ensure_packaged_generator
    from generation.local import LocalGenerator

    model_dir = ensure_packaged_generator(REPO / "ragbudget-data")
    gens = {p: LocalGenerator(model_dir, device="cpu", threads=threads, precision=p, prefix_cache_mib=0)
            for p in ("fp32", "bf16")}
    cells = [("prefill", n, 1) for n in prompts] + [("tpot", c, k) for c in contexts for k in (1, 4)]
    got: dict[tuple[str, str, int, int], list[float]] = {}
    for g in gens.values():  # warm every shape once, untimed
        g.prefill_ms(prompts[0], 0)
        g.step_ms(0, 0, [contexts[0]] * 4)
    for r in range(rounds):
        for kind, n, k in cells:
            for p in (("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32")):
                g = gens[p]
                ms = g.prefill_ms(n, 0) if kind == "prefill" else g.step_ms(0, 0, [n] * k)
                got.setdefault((p, kind, n, k), []).append(ms)
    out: dict[str, Any] = {"machine": machine_line(), "rounds": rounds,
                           "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cells": []}
    for kind, n, k in cells:
        f32, b16 = (statistics.median(got[(p, kind, n, k)]) for p in ("fp32", "bf16"))
        row = {"kind": kind, "tokens" if kind == "prefill" else "context": n, "answers": k,
               "fp32_ms": round(f32, 1), "bf16_ms": round(b16, 1), "fp32_over_bf16": round(f32 / b16, 2)}
        if kind == "prefill":
            row.update(fp32_tok_s=round(n / f32 * 1000), bf16_tok_s=round(n / b16 * 1000))
        out["cells"].append(row)
        print(row, flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    """Print GEMM timings and invariance findings per shape and precision (``--engine``: the
    local engine's prefill and TPOT in fp32 against bf16, :func:`engine_timing`)."""
    import torch

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,16,64,256,600")
    ap.add_argument("--precisions", default="fp32,bf16,autocast")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ref-rows", type=int, default=600)
    ap.add_argument("--max-m", type=int, default=64, help="row counts 1..max-m are checked")
    ap.add_argument("--offsets", default="0,7,100")
    ap.add_argument("--no-invariance", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--shapes", default="", help="comma list of shape names (default: all)")
    ap.add_argument("--engine", action="store_true", help="time the local engine in fp32 and bf16 "
                    "(prefill of --prompts tokens, TPOT at 1 and 4 answers at --contexts) instead")
    ap.add_argument("--prompts", default="600,1500")
    ap.add_argument("--contexts", default="600")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="", help="--engine: also write the figures here")
    a = ap.parse_args(argv)
    if a.engine:
        print(f"machine: {machine_line()}; torch {torch.__version__}, threads {a.threads}", flush=True)
        res = engine_timing(a.threads, a.rounds, [int(x) for x in a.prompts.split(",")],
                            [int(x) for x in a.contexts.split(",")])
        if a.json:
            import json

            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    torch.set_num_threads(a.threads)
    rows = [int(x) for x in a.rows.split(",")]
    precisions = a.precisions.split(",")
    offsets = [int(x) for x in a.offsets.split(",")]
    print(f"machine: {machine_line()}; torch {torch.__version__}, threads {a.threads}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"mkldnn bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    g = torch.Generator().manual_seed(0)
    shapes = [s for s in SHAPES if not a.shapes or s[0] in a.shapes.split(",")]
    print("time: median ms (GFLOP/s) per row count")
    print(f"{'shape':>9} {'prec':>9} " + " ".join(f"{'M=' + str(m):>17}" for m in rows))
    for name, k, n in shapes if not a.no_timing else []:
        w = (torch.randn(n, k, generator=g) * 0.05).contiguous()
        x = torch.randn(max(rows + [a.ref_rows]), k, generator=g)
        for p in precisions:
            op = _ops(p, w)
            cells = []
            for m in rows:
                xm = x[:m].contiguous()
                ms = _time_ms(lambda op=op, xm=xm: op(xm), a.repeats if n < 10000 else max(2, a.repeats // 2))
                cells.append(f"{ms:8.3f} ({2 * m * k * n / ms / 1e6:5.0f})")
            print(f"{name:>9} {p:>9} " + " ".join(f"{c:>17}" for c in cells), flush=True)
    if a.no_invariance:
        return
    print(f"invariance: row counts M in 1..{a.max_m} (offsets {offsets}) whose rows differ from a "
          f"{a.ref_rows}-row product; and M in 16..{a.max_m} step 8 (engine padding)")
    for name, k, n in shapes:
        w = (torch.randn(n, k, generator=g) * 0.05).contiguous()
        x = torch.randn(a.ref_rows, k, generator=g)
        for p in precisions:
            op = _ops(p, w)
            ref = op(x)
            bad = differing_rows(op, x, ref, a.max_m, offsets)
            padded_bad = [m for m in bad if m >= 16 and m % 8 == 0]
            print(f"{name:>9} {p:>9} differ at M = {_ranges(bad)}; padded M differ: "
                  f"{_ranges(padded_bad)}", flush=True)
    for label, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        print(f"attention {label}: chunked prefill of {a.ref_rows} rows identical to one shot: "
              f"{attention_split(dt, a.ref_rows, [16, 64, 256])}", flush=True)


if __name__ == "__main__":
    main()
