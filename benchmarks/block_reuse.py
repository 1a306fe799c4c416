"""TTFT cold vs warm on the local engine when the first ``k`` blocks of a prompt are cached.

The prefix cache (``generation.engine.kv_cache.BlockPrefixCache``) keeps the scaffold and every
full prefill chunk after it as blocks. A prompt of the app's scaffold, ``--blocks`` chunks of
retrieved-looking text (``--chunk`` tokens each, the engine's prefill chunk) and a question is
answered with ``max_new_tokens=1``: cold (empty cache), and warm with the scaffold plus the
first ``k`` chunk blocks cached (for ``k = 0 .. --blocks``), the cache filled each time by
another prompt with that same head and a different tail (so only those blocks can be reused).
TTFT is the generator's own ``prefill_ms`` (admission, cache copy included, to the first
token); medians of ``--repeats`` runs visited in a rotated order. Every warm run's first token
is checked against the cold one (the reuse is exact by construction; a mismatch is printed).

    python -m benchmarks.block_reuse --threads 2 --chunk 256 --blocks 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder
from benchmarks.common import machine_line
from generation.base import GenParams
from generation.local import LocalGenerator

FILLER = ("The pump station log lists every inspection with its date, the engineer on duty, the pressure "
          "readings at each valve and the filters that were cleaned or replaced during the visit. ")
QUESTION = "When was the last valve of the pump station replaced, and by whom?"
OTHER_TAIL = "Which filters were cleaned during the inspection in March?"


def first_token(gen: LocalGenerator, ids: list[int], scaffold: int) -> tuple[int, float, int]:
    """``(first token id, TTFT ms, cached tokens)`` of one answer with ``max_new_tokens=1``."""
    stream = gen.stream(ids, cached_prefix_ids=ids[:scaffold],
                        params=GenParams(max_new_tokens=1, ignore_eos=True))
    toks = [e.token_id for e in stream]
    stats = stream.stats
    assert stats is not None
    return toks[0], float(stats.prefill_ms), int(stats.cached_tokens)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure; returns the rows (also printed as a markdown table)."""
    from generation.assets import ensure_packaged_generator

    model_dir = Path(args.model_dir) if args.model_dir else ensure_packaged_generator(Path(args.data_dir))
    gen = LocalGenerator(model_dir, device=args.device, threads=args.threads, prefill_chunk=args.chunk,
                         step_token_budget=args.chunk)
    builder = PromptBuilder.for_generator(gen)
    scaffold = builder.scaffold_ids(DEFAULT_SCAFFOLD_TEXT)
    body: list[int] = []
    while len(body) < args.blocks * args.chunk:
        body += builder.encode_plain(FILLER)
    body = body[:args.blocks * args.chunk]
    question = builder.encode_plain(QUESTION)
    other = builder.encode_plain(OTHER_TAIL)
    prompt = scaffold + body + question
    p = len(scaffold)
    first_token(gen, prompt, p)  # warm-up (allocations, first-call costs)
    variants: list[int | None] = [None, *range(args.blocks + 1)]  # None: cold
    times: dict[int | None, list[float]] = {v: [] for v in variants}
    cached: dict[int | None, int] = {}
    tokens: dict[int | None, set[int]] = {v: set() for v in variants}
    for rep in range(args.repeats):
        for v in variants[rep % len(variants):] + variants[:rep % len(variants)]:
            gen.prefix_cache.clear()
            if v is not None:  # another prompt with the same first v blocks fills the cache
                first_token(gen, prompt[:p + v * args.chunk] + other, p)
            tok, ms, c = first_token(gen, prompt, p)
            times[v].append(ms)
            cached[v] = c
            tokens[v].add(tok)
    cold = statistics.median(times[None])
    rows = []
    for v in variants:
        med = statistics.median(times[v])
        rows.append({"cached_blocks": "cold" if v is None else f"scaffold + {v}",
                     "prompt_tokens": len(prompt), "cached_tokens": cached[v],
                     "computed_tokens": len(prompt) - cached[v], "ttft_p50_ms": med,
                     "ttft_ms": times[v], "vs_cold": med / cold,
                     "same_first_token": tokens[v] == tokens[None]})
    ident = gen.identity
    print(f"# {ident['model_id']} {ident['device_name']} {ident['dtype']} threads={ident['threads']} "
          f"prefill_chunk={args.chunk} repeats={args.repeats}; {machine_line()}")
    print("| cached | prompt | cached tokens | computed | TTFT p50 ms | vs cold | same first token |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['cached_blocks']} | {r['prompt_tokens']} | {r['cached_tokens']} "
              f"| {r['computed_tokens']} | {r['ttft_p50_ms']:.1f} | {r['vs_cold']:.2f} "
              f"| {r['same_first_token']} |")
    st = gen.prefix_cache.stats()
    mib = 1 << 20
    print(f"# cache: {st.blocks} blocks, {st.bytes / mib:.1f} MiB of {st.budget_bytes / mib:.0f} MiB")
    return {"identity": ident, "chunk": args.chunk, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="HF model dir (default: packaged SmolLM2)")
    ap.add_argument("--data-dir", default="ragbudget-data")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk = block size, tokens")
    ap.add_argument("--blocks", type=int, default=4, help="chunk blocks after the scaffold")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
