"""TTFT and TPOT of one model through ragbudget's local engine and through llama.cpp's server, side by side.

The same GGUF (the packaged SmolLM2-135M-Instruct Q4_1) on the same machine:

* ``local``: :class:`generation.local.LocalGenerator` on the fp32 copy ragbudget
  converts the GGUF into (transformers, ``--threads`` torch threads), its own
  scaffold prefix KV cache warm.
* ``llama.cpp``: :class:`generation.remote.RemoteGenerator` against
  ``python -m llama_cpp.server`` (llama-cpp-python built by
  ``scripts/install_llama_server.sh``) serving the Q4_1 GGUF as is with
  ``--threads`` threads, through loopback HTTP (text prompts checked against the
  server's tokenizer); its prompt cache reuses the scaffold of the previous prompt.

Each repeat builds a fresh prompt (same scaffold, ``--chunks`` chunks, a new
question), then runs it on both engines in alternating order (A B, B A, ...), greedy,
``--tokens`` output tokens at most. TTFT is each generator's ``prefill_ms`` (stream start
to first token with text; HTTP included for the server); TPOT is vLLM's
``(t_last - t_first) / (n - 1)``. Reported: medians, and the llama.cpp / local ratio of
the medians. The prompt sizes and token counts are the same for both (ids are
checked on the server side). The CPU model, core count and load average before and
after are printed with the numbers.

    flock /tmp/ragbudget-cpu.lock python -m benchmarks.engines --repeats 7 --tokens 32

``--matrix`` measures the engines' raw speed instead, one run, rounds interleaved (every
engine measured once per round, the order rotating): the local engine in each of
``--precisions`` (fp32, bf16, int8; :mod:`generation.precision`), llama.cpp's native
``llama-server`` (``--parallel 4`` slots, the same Q4_1 GGUF, its own ``timings``) and plain
transformers (fp32, SDPA, ``DynamicCache``). Cells: prefill of ``--prompts`` tokens alone,
cold (tokens/s), and TPOT at 1 and 4 answers at context ``--context`` (ms per decode step),
plus physical floors: a decode step's weight bytes over the measured memory read bandwidth,
and a prompt's FLOPs over the measured GEMM peak of each precision (:func:`floors`).

    flock /tmp/ragbudget-cpu.lock python -m benchmarks.engines --matrix --rounds 5 \
        --json benchmarks/results/engines-matrix.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, cpu_model, elapsed_ms

TOPICS = ["inspection", "valve", "filter", "alarm", "pressure", "bearing", "backwash", "odour", "gauge"]


def chunk_text(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return (f"Maintenance note {i} on the {topic}. The duty engineer records the {topic} readings at the "
            "start of the shift, compares them with the previous week, and writes down any change larger "
            "than five percent together with the time, the station and the action taken. ") * 2



def run_once(gen: Any, prompt: Any, tokens: int) -> dict[str, Any]:
    from generation.base import GenParams

    t0 = time.perf_counter()
    answer = gen.stream(prompt.ids, cached_prefix_ids=prompt.scaffold_ids,
                        params=GenParams(max_new_tokens=tokens))
    n = sum(1 for _ in answer)
    s = answer.stats
    return {"ttft_ms": s.prefill_ms, "tpot_ms": s.tpot_ms, "events": n,
            "output_tokens": s.output_tokens, "wall_ms": elapsed_ms(t0)}


def _median_ms(fn: Any, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after one untimed call, ms."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(elapsed_ms(t0))
    return statistics.median(times)


def floors(threads: int, model_dir: Path, gguf: Path) -> dict[str, Any]:
    """Physical floors of this machine for the packaged model, and how they were measured.

    * ``read_gb_s``: memory read bandwidth, a ``torch.sum`` over a 1 GiB fp32 tensor at
      ``threads`` threads (median of 5), GB/s (1e9 bytes).
    * ``peak_gflops``: GEMM peak per precision: fp32 ``torch.mm`` (MKL), bf16 ``F.linear``
      (oneDNN), int8 ``torch._int_mm`` (oneDNN VNNI, GOP/s), on 2048 x 2048 x 2048 (median of 5).
    * ``decode_bytes``: bytes of weights one decode step reads per precision (every linear
      layer's weight, the tied LM head included; the embedding row and norms are negligible);
      llama.cpp: the GGUF's size. ``decode_floor_ms`` = bytes / bandwidth.
    * ``prefill_flops(n)``: ``2 * n * (linear params - LM head)`` + ``2 * LM head`` (one
      logits row) + attention ``4 * n * (n + 1) / 2 * hidden * layers`` (causal QK^T and PV);
      ``prefill_floor_ms`` at each precision's peak (attention at fp32's).
    """
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    big = torch.ones(1 << 28)  # 1 GiB fp32
    read_ms = _median_ms(big.sum, 5)
    read_gb_s = big.numel() * 4 / read_ms / 1e6
    big = torch.empty(0)
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    ab, bb = a.bfloat16(), b.bfloat16()
    ai = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    bi = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    peak = {"fp32": 2 * n ** 3 / _median_ms(lambda: torch.mm(a, b), 5) / 1e6,
            "bf16": 2 * n ** 3 / _median_ms(lambda: F.linear(ab, bb), 5) / 1e6,
            "int8": 2 * n ** 3 / _median_ms(lambda: torch._int_mm(ai, bi.t()), 5) / 1e6}
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kvh, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    hd = h // heads
    linear_params = layers * (2 * h * h + 2 * h * kvh * hd + 3 * h * inter) + h * vocab
    decode_bytes = {"fp32": 4 * linear_params, "bf16": 2 * linear_params, "int8": linear_params,
                    "llama.cpp (Q4_1 GGUF)": gguf.stat().st_size}
    out: dict[str, Any] = {"read_gb_s": read_gb_s, "peak_gflops": peak, "linear_params": linear_params,
                           "decode_bytes": decode_bytes,
                           "decode_floor_ms": {k: v / read_gb_s / 1e6 for k, v in decode_bytes.items()},
                           "prefill_floor_ms": {}}
    for p in ("fp32", "bf16", "int8"):
        out["prefill_floor_ms"][p] = {}
    for tokens in (600, 1500):
        lin = 2 * tokens * (linear_params - h * vocab) + 2 * h * vocab
        att = 4 * tokens * (tokens + 1) / 2 * heads * hd * layers
        for p in ("fp32", "bf16", "int8"):
            out["prefill_floor_ms"][p][tokens] = lin / peak[p] / 1e6 + att / peak["fp32"] / 1e6
    return out


def _hf_cells(model: Any, ids: list[int], prompts: list[int], context: int) -> dict[str, float]:
    """Plain transformers: prefill of each prompt size (one forward, no cache) and the median
    of 6 one-token decode steps at ``context`` for 1 and 4 sequences (``DynamicCache``), ms."""
    import torch
    from transformers import DynamicCache

    out: dict[str, float] = {}
    with torch.inference_mode():
        for n in prompts:
            x = torch.tensor([ids[:n]])
            t0 = time.perf_counter()
            model(input_ids=x, use_cache=False, logits_to_keep=1)
            out[f"prefill_{n}"] = elapsed_ms(t0)
        for k in (1, 4):
            x = torch.tensor([ids[i:i + context] for i in range(k)])  # (k, context)
            cache = DynamicCache()
            logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[:, -1]
            steps = []
            for _ in range(6):
                nxt = logits.argmax(-1, keepdim=True)  # (k, 1)
                t0 = time.perf_counter()
                logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
                steps.append(elapsed_ms(t0))
            out[f"tpot_{k}"] = statistics.median(steps)
    return out


def _llama_cells(root_url: str, ids: list[int], prompts: list[int], context: int,
                 shift: int) -> dict[str, float]:
    """llama.cpp's native server, its own ``timings``: prompt ms of each prompt size (1 token
    predicted, no prompt cache), and ``predicted_per_token_ms`` of 33 tokens after a
    ``context``-token prompt, 1 request alone and 4 at once (4 slots; median of the 4)."""
    import threading

    import httpx

    def complete(prompt: list[int], n_predict: int) -> dict[str, Any]:
        r = httpx.post(f"{root_url}/completion", timeout=300.0,
                       json={"prompt": prompt, "n_predict": n_predict, "cache_prompt": False,
                             "temperature": 0.0, "ignore_eos": True})
        r.raise_for_status()
        return dict(r.json()["timings"])

    out: dict[str, float] = {}
    for n in prompts:
        t = complete(ids[shift:shift + n], 1)
        assert int(t["prompt_n"]) == n, t
        out[f"prefill_{n}"] = float(t["prompt_ms"])
    out["tpot_1"] = float(complete(ids[shift:shift + context], 33)["predicted_per_token_ms"])
    got: list[float] = []
    threads = [threading.Thread(target=lambda i=i: got.append(float(complete(
        ids[shift + 7 * i + 1:shift + 7 * i + 1 + context], 33)["predicted_per_token_ms"])))
        for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    out["tpot_4"] = statistics.median(got)
    return out


def matrix(args: Any) -> int:
    """``--matrix``: the local engine per precision vs llama.cpp vs transformers (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.common import machine_line
    from generation.assets import ensure_packaged_generator, packaged_gguf_path
    from generation.local import LocalGenerator
    from ragbudget_testing.llama_server import NativeLlamaServer

    prompts = [int(x) for x in args.prompts.split(",")]
    precisions = args.precisions.split(",")
    load_start = os.getloadavg()
    utc_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    model_dir = ensure_packaged_generator(REPO / "ragbudget-data")
    gguf = packaged_gguf_path()
    fl = floors(args.threads, model_dir, gguf)
    print(f"floors: {json.dumps(fl)}", file=sys.stderr, flush=True)
    locals_ = {p: LocalGenerator(model_dir, device="cpu", threads=args.threads, precision=p,
                                 prefix_cache_mib=0) for p in precisions}
    ids = next(iter(locals_.values()))._synthetic_ids(max(prompts) + 64)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                              attn_implementation="sdpa").eval()
    log = Path(tempfile.mkdtemp(prefix="ragbudget-engines-")) / "llama-server.log"
    cells: dict[str, dict[str, list[float]]] = {}

    def local_cells(g: Any) -> dict[str, float]:
        out = {f"prefill_{n}": g.prefill_ms(n, 0) for n in prompts}
        for k in (1, 4):
            out[f"tpot_{k}"] = statistics.median(g.step_ms(0, 0, [args.context] * k) for _ in range(5))
        return out

    def hf_cells() -> dict[str, float]:
        torch.set_num_threads(args.threads)  # the local engines set theirs on the compute thread
        return _hf_cells(hf, ids, prompts, args.context)

    server = NativeLlamaServer(gguf, log, alias="smollm2", n_ctx=4 * 2048, threads=args.threads,
                               parallel=4)
    with server if not args.no_llama else contextlib.nullcontext():
        runners: dict[str, Any] = {f"local {p}": (lambda g=g: local_cells(g)) for p, g in locals_.items()}
        if not args.no_llama:
            runners["llama.cpp"] = lambda: _llama_cells(server.root_url, ids, prompts, args.context, 0)
        if not args.no_transformers:
            runners["transformers fp32"] = hf_cells
        for fn in runners.values():  # warm-up, untimed
            fn()
        names = list(runners)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                got = runners[name]()
                for key, ms in got.items():
                    cells.setdefault(name, {}).setdefault(key, []).append(ms)
                print(f"[{r + 1}/{args.rounds}] {name:18s} " + "  ".join(
                    f"{k} {v:7.1f}" for k, v in got.items()), file=sys.stderr, flush=True)
    load_end = os.getloadavg()
    summary: dict[str, dict[str, float]] = {}
    for name, per in cells.items():
        row = {k: statistics.median(v) for k, v in per.items()}
        for n in prompts:
            row[f"prefill_{n}_tok_s"] = n / row[f"prefill_{n}"] * 1000.0
        summary[name] = row
    fp32 = summary.get("local fp32", {})
    lcpp = summary.get("llama.cpp", {})
    goals: dict[str, Any] = {}
    for name, row in summary.items():
        if not name.startswith("local") or not fp32 or not lcpp:
            continue
        goals[name] = {
            "tpot1_le_llama_cpp": row["tpot_1"] <= lcpp["tpot_1"],
            "tpot4_le_1.3x_tpot1": row["tpot_4"] <= 1.3 * row["tpot_1"],
            "prefill_ge_2x_fp32": all(row[f"prefill_{n}_tok_s"] >= 2 * fp32[f"prefill_{n}_tok_s"]
                                      for n in prompts)}
    out = {"machine": machine_line(), "cpu": cpu_model(), "cores": os.cpu_count(),
           "threads": args.threads, "loadavg_start": load_start, "loadavg_end": load_end,
           "utc_start": utc_start, "utc_end": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "torch": torch.__version__, "rounds": args.rounds, "context": args.context,
           "model": "SmolLM2-135M-Instruct: Q4_1 GGUF (llama.cpp), its fp32 conversion (local, transformers)",
           "floors": fl, "summary": summary, "goals": goals, "runs": cells}
    print(f"\n# {out['cpu']} | {out['cores']} cores | threads {args.threads} | loadavg "
          f"{load_start[0]:.2f} -> {load_end[0]:.2f} | {utc_start} .. {out['utc_end']}")
    head = "".join(f"{'prefill ' + str(n) + ' tok/s':>20}" for n in prompts)
    print(f"{'engine':18s}{head}{'TPOT 1 (ms)':>14}{'TPOT 4 (ms)':>14}")
    for name, row in summary.items():
        print(f"{name:18s}" + "".join(f"{row[f'prefill_{n}_tok_s']:20.0f}" for n in prompts)
              + f"{row['tpot_1']:14.1f}{row['tpot_4']:14.1f}")
    print(f"floors: read {fl['read_gb_s']:.1f} GB/s; decode step "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in fl["decode_floor_ms"].items())
          + "; GEMM peak " + ", ".join(f"{k} {v:.0f}" for k, v in fl["peak_gflops"].items()) + " GFLOP/s")
    print(f"goals: {json.dumps(goals)}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--matrix", action="store_true", help="raw speed of every engine and precision "
                    "(prefill tokens/s, TPOT at 1 and 4 answers) plus physical floors")
    ap.add_argument("--floors-only", action="store_true", help="only the physical floors (floors())")
    ap.add_argument("--no-llama", action="store_true", help="--matrix without llama.cpp's server "
                    "(its idle threads poll and take CPU from the other engines)")
    ap.add_argument("--no-transformers", action="store_true", help="--matrix without plain transformers")
    ap.add_argument("--precisions", default="fp32,bf16,int8")
    ap.add_argument("--prompts", default="600,1500")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.floors_only:
        from generation.assets import ensure_packaged_generator, packaged_gguf_path

        fl = floors(args.threads, ensure_packaged_generator(REPO / "ragbudget-data"), packaged_gguf_path())
        fl.update(cpu=cpu_model(), cores=os.cpu_count(), threads=args.threads, loadavg=os.getloadavg(),
                  utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        print(json.dumps(fl, indent=1))
        if args.json:
            args.json.write_text(json.dumps(fl, indent=1))
        return 0
    if args.matrix:
        return matrix(args)

    from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder, PromptChunk
    from generation.assets import ensure_packaged_generator, load_tokenizer, packaged_gguf_path
    from generation.local import LocalGenerator
    from generation.remote import RemoteGenerator
    from ragbudget_testing.llama_server import LlamaCppServer
    from retrieval.tokens import HFTextTokenizer

    load_start = os.getloadavg()
    model_dir = ensure_packaged_generator(REPO / "ragbudget-data")
    tok = HFTextTokenizer(load_tokenizer(model_dir), name=str(model_dir))
    builder = PromptBuilder.for_tokenizer(tok)
    local = LocalGenerator(model_dir, tokenizer=tok, device="cpu", dtype="float32", threads=args.threads,
                           stop_token_ids=builder.end_of_turn_ids)
    log = Path(tempfile.mkdtemp(prefix="ragbudget-engines-")) / "llama-server.log"
    results: dict[str, list[dict[str, Any]]] = {"local": [], "llama.cpp": []}
    with LlamaCppServer(packaged_gguf_path(), log, alias="smollm2", n_ctx=8192,
                        threads=args.threads) as server:
        remote = RemoteGenerator(server.base_url, "smollm2", tokenizer=tok, context_window=8192,
                                 stop_token_ids=builder.end_of_turn_ids)
        engines = {"local": local, "llama.cpp": remote}
        scaffold = builder.scaffold_ids(DEFAULT_SCAFFOLD_TEXT)
        for gen in engines.values():
            gen.warm_prefix(scaffold)
        warm = builder.build(DEFAULT_SCAFFOLD_TEXT, [PromptChunk(0, 1, chunk_text(99))], "Warm-up?")
        for gen in engines.values():
            run_once(gen, warm, 4)
        for r in range(args.repeats):
            chunks = [PromptChunk(i, 1, chunk_text(r * args.chunks + i)) for i in range(args.chunks)]
            prompt = builder.build(DEFAULT_SCAFFOLD_TEXT, chunks,
                                   f"What does the engineer record about the {TOPICS[r % len(TOPICS)]}?")
            order = ["local", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "local"]
            for name in order:
                row = run_once(engines[name], prompt, args.tokens)
                row.update({"repeat": r, "prompt_tokens": prompt.prompt_tokens})
                results[name].append(row)
                print(f"[{r + 1}/{args.repeats}] {name:9s} prompt {prompt.prompt_tokens} tok  TTFT "
                      f"{row['ttft_ms']:7.1f} ms  TPOT {row['tpot_ms'] or float('nan'):6.1f} ms  "
                      f"out {row['output_tokens']}", file=sys.stderr, flush=True)
        hits = server.prefix_hits()
    load_end = os.getloadavg()

    def med(name: str, key: str) -> float:
        vals = [row[key] for row in results[name] if row[key] is not None]
        return statistics.median(vals) if vals else float("nan")

    summary = {name: {"ttft_ms_median": med(name, "ttft_ms"), "tpot_ms_median": med(name, "tpot_ms"),
                      "output_tokens_median": med(name, "output_tokens")} for name in results}
    summary["ratio_llama_cpp_over_local"] = {
        "ttft": summary["llama.cpp"]["ttft_ms_median"] / summary["local"]["ttft_ms_median"],
        "tpot": summary["llama.cpp"]["tpot_ms_median"] / summary["local"]["tpot_ms_median"]}
    out = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": args.threads,
                       "loadavg_start": load_start, "loadavg_end": load_end},
           "model": "SmolLM2-135M-Instruct Q4_1 GGUF (local: dequantised to fp32)",
           "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in results["local"]),
           "engine_prefix_hits": hits[-args.repeats:], "summary": summary, "runs": results}
    print(f"\n# {out['machine']['cpu']} | {os.cpu_count()} cores | threads {args.threads} | loadavg "
          f"{load_start[0]:.2f} -> {load_end[0]:.2f}")
    print(f"# prompt ~{out['prompt_tokens_median']:.0f} tokens (scaffold cached), up to {args.tokens} "
          f"output tokens, {args.repeats} interleaved repeats")
    for name in ("local", "llama.cpp"):
        s = summary[name]
        print(f"{name:10s} TTFT median {s['ttft_ms_median']:7.1f} ms   "
              f"TPOT median {s['tpot_ms_median']:6.1f} ms")
    r = summary["ratio_llama_cpp_over_local"]
    print(f"llama.cpp / local: TTFT x{r['ttft']:.2f}, TPOT x{r['tpot']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
