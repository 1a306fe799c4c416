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
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

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
