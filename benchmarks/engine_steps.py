"""Prefill and decode cost of the batching engine against a plain transformers forward.

One process, the packaged SmolLM2 (fp32, CPU), interleaved repeats. For each prompt
length N: the engine's prefill of one answer alone (to its first token) at each prefill
chunk size, and transformers' own full-sequence forward with SDPA attention and a KV cache
(the path before the engine). Then one decode step of one answer after N tokens: the
engine's (padded to ``padded_rows`` rows for batch invariance) and transformers' (one row).
Prints medians in ms and the ratio to transformers.

    python -m benchmarks.engine_steps --lengths 600,1500 --chunks 64,128,256,512 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.common import elapsed_ms, machine_line
from generation.assets import ensure_packaged_generator
from generation.base import GenParams
from generation.local import LocalGenerator


def _since(t0: float) -> float:
    return elapsed_ms(t0)


def main(argv: list[str] | None = None) -> None:
    """Print prefill/decode medians (ms) for the engine and plain transformers."""

    import torch
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data-dir", default=".ragbudget-bench")
    ap.add_argument("--lengths", default="600,1500")
    ap.add_argument("--chunks", default="64,128,256,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    chunks = [int(x) for x in a.chunks.split(",")]
    model_dir = ensure_packaged_generator(Path(a.data_dir))
    gen = LocalGenerator(model_dir, threads=a.threads)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="sdpa").eval()
    print(f"machine: {machine_line()}; torch {torch.__version__}, threads {a.threads}")
    for n in lengths:
        ids = gen._synthetic_ids(n)
        x = torch.tensor([ids])
        times: dict[str, list[float]] = {}
        for _ in range(a.repeats):  # interleaved: every variant once per round
            for chunk in chunks:
                seq = gen._sequence(ids, 0, GenParams(max_new_tokens=1), chunk=chunk)
                with gen._lock:
                    t0 = time.perf_counter()
                    gen.engine.run_alone(seq)
                    times.setdefault(f"engine chunk {chunk}", []).append(_since(t0))
            with torch.inference_mode():
                t0 = time.perf_counter()
                hf(input_ids=x, use_cache=True)
                times.setdefault("transformers", []).append(_since(t0))
        base = statistics.median(times["transformers"])
        for name, xs in times.items():
            med = statistics.median(xs)
            print(f"prefill N={n:5d} {name:20s} {med:8.1f} ms  x{med / base:.2f}")
        seq = gen._sequence(ids, 0, GenParams(max_new_tokens=10 * a.repeats + 2), eos=frozenset())
        with gen._lock, torch.inference_mode():
            gen.engine.run_alone(seq)
            out = hf(input_ids=x, use_cache=True)
            cache = out.past_key_values
            tok = torch.tensor([[5]])
            eng, ref = [], []
            for _ in range(5 * a.repeats):
                t0 = time.perf_counter()
                gen.engine.step([seq])
                eng.append(_since(t0))
                t0 = time.perf_counter()
                hf(input_ids=tok, past_key_values=cache, use_cache=True)
                ref.append(_since(t0))
        e, r = statistics.median(eng), statistics.median(ref)
        print(f"decode  N={n:5d} engine {e:.1f} ms, transformers {r:.1f} ms, x{e / r:.2f}")


if __name__ == "__main__":
    main()
