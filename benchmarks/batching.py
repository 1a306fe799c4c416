"""Batched vs one-at-a-time answers on the local engine, same process, same prompts.

For each client count C, C answers arrive at once (threads) on the packaged
SmolLM2 with a shared warm scaffold; each prompt is the scaffold plus
``--context`` filler tokens plus a distinct question, ``--max-new`` greedy tokens
(EOS ignored is not possible here, so answers may stop early; the token counts
are printed). Mode ``batched`` runs the engine with ``max_running = C``; mode
``serial`` with ``max_running = 1`` (the old one-at-a-time behaviour, the rest
wait in the engine's queue). Per mode: TTFT p50/p95 from arrival (queue wait
included), TPOT mean, wall time, answers per minute, and whether every answer's
token ids equal the serial run's.

    python -m benchmarks.batching --clients 1,2,4,8 --threads 2 --context 200 --max-new 16
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder, PromptChunk
from benchmarks.common import quantile
from generation.assets import ensure_packaged_generator
from generation.base import GenParams
from generation.local import LocalGenerator

FILLER = ("The pump station log lists every inspection with its date, the engineer on duty, the pressure "
          "readings at each valve and the filters that were cleaned or replaced during the visit. ")


def _run(gen: LocalGenerator, prompts: list[Any], max_new: int) -> dict[str, Any]:
    out: dict[int, dict[str, Any]] = {}
    start = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        ids, first, last = [], None, None
        for ev in gen.stream(prompts[i].ids, cached_prefix_ids=prompts[i].scaffold_ids,
                             params=GenParams(max_new_tokens=max_new)):
            ids.append(ev.token_id)
            first = first if first is not None else ev.t
            last = ev.t
        out[i] = {"ids": ids, "ttft_ms": ((first or time.perf_counter()) - t0) * 1000.0,
                  "tpot_ms": ((last - first) * 1000.0 / (len(ids) - 1))
                  if first is not None and last is not None and len(ids) > 1 else None}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = [o["ttft_ms"] for o in out.values()]
    tpots = [o["tpot_ms"] for o in out.values() if o["tpot_ms"] is not None]
    return {"wall_s": wall, "ttft_p50": quantile(ttfts, 0.5), "ttft_p95": quantile(ttfts, 0.95),
            "tpot_mean": statistics.fmean(tpots) if tpots else float("nan"),
            "answers_per_min": len(prompts) * 60.0 / wall,
            "tokens": sum(len(o["ids"]) for o in out.values()),
            "ids": [out[i]["ids"] for i in range(len(prompts))]}


def main() -> None:
    """Print one row per (clients, mode); see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=200, help="filler tokens per prompt (approx.)")
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--data-dir", default="ragbudget-data")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    gen = LocalGenerator(ensure_packaged_generator(Path(args.data_dir)), device="cpu", dtype="float32",
                         threads=args.threads, max_running=max(clients))
    builder = PromptBuilder.for_generator(gen)
    filler = FILLER * max(1, args.context // 30)
    prompts = [builder.build(DEFAULT_SCAFFOLD_TEXT, [PromptChunk(1, 1, filler)],
                             f"Question {i}: who was on duty at valve {i + 3}?") for i in range(max(clients))]
    gen.warm_prefix(prompts[0].scaffold_ids)
    print(f"prompt tokens ~{prompts[0].prompt_tokens}, scaffold {prompts[0].scaffold_len}, "
          f"max_new {args.max_new}, threads {args.threads}, chunk {gen.prefill_chunk}")
    print("clients mode     wall_s  ttft_p50  ttft_p95  tpot_ms  answers/min  tokens  same_ids")
    for c in clients:
        rows = {}
        for mode, running in (("serial", 1), ("batched", c)):
            gen.engine.max_running = running
            rows[mode] = _run(gen, prompts[:c], args.max_new)
        for mode, r in rows.items():
            same = r["ids"] == rows["serial"]["ids"]
            print(f"{c:7d} {mode:8s} {r['wall_s']:6.2f} {r['ttft_p50']:9.0f} {r['ttft_p95']:9.0f} "
                  f"{r['tpot_mean']:8.1f} {r['answers_per_min']:12.1f} {r['tokens']:7d}  {same}")


if __name__ == "__main__":
    main()
