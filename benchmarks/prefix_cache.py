"""Warm vs cold scaffold TTFT on the local generator, against the latency model's predicted saving.

For each (scaffold tokens, context tokens) the same prompt is prefilled with
``max_new_tokens=1``: cold (prefix cache emptied, so the scaffold is computed and
stored), warm (scaffold KV copied from the cache) and with no prefix at all.
TTFT here is the generator's own ``prefill_ms`` (prefill start to first token),
median of ``--repeats`` interleaved runs. The predicted saving is
``p50(n, 0) - p50(n, scaffold)`` from ``--profile`` (a saved profile JSON) or,
without one, the roofline prior (labelled ``prior``); ``-`` when neither loads.

    python benchmarks/prefix_cache.py --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from app.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder, PromptChunk
from generation.base import GenParams
from generation.local import LocalGenerator

EXTRA_RULE = ("Quote numbers, dates and part names exactly as the sources write them, and never combine "
              "facts from different sources into a claim that none of them makes. ")
FILLER = ("The pump station log lists every inspection with its date, the engineer on duty, the pressure "
          "readings at each valve and the filters that were cleaned or replaced during the visit. ")


def sized(base: str, extra: str, tokens: int, measure: Any) -> str:
    """``base`` extended with ``extra`` until ``measure(text) >= tokens``."""
    text = base
    while measure(text) < tokens:
        text += (" " if text else "") + extra
    return text


def predictor(args: argparse.Namespace, gen: LocalGenerator) -> tuple[Any, str]:
    try:
        if args.profile:
            from latency_model.profile import Profile

            return Profile.from_json(Path(args.profile).read_bytes()), "profile"
        from latency_model.calibration import make_prior

        return make_prior(dict(gen.identity), gen.config_dict()), "prior"
    except Exception as exc:  # noqa: BLE001 - the columns stay placeholders
        print(f"# no prediction: {type(exc).__name__}: {exc}")
        return None, "-"


def ttft_ms(gen: LocalGenerator, ids: list[int], prefix: list[int] | None) -> float:
    list(gen.stream(ids, cached_prefix_ids=prefix, params=GenParams(max_new_tokens=1)))
    assert gen.last_stats is not None
    return gen.last_stats.prefill_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="HF model dir (default: packaged SmolLM2)")
    ap.add_argument("--data-dir", default="ragbudget-data")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scaffold-tokens", default="80,256,768")
    ap.add_argument("--context-tokens", default="128,512")
    ap.add_argument("--profile", default=None, help="latency profile JSON for the predicted column")
    args = ap.parse_args()

    from generation.assets import ensure_packaged_generator

    model_dir = Path(args.model_dir) if args.model_dir else ensure_packaged_generator(Path(args.data_dir))
    gen = LocalGenerator(model_dir, device=args.device, threads=args.threads)
    builder = PromptBuilder.for_generator(gen)
    model, source = predictor(args, gen)
    ident = gen.identity
    print(f"# {ident['model_id']} {ident['device_name']} {ident['dtype']} threads={ident['threads']} "
          f"repeats={args.repeats} prediction={source}")
    print("| scaffold | context | prompt | no-cache ms | cold ms | warm ms | saving ms | saving % "
          "| predicted saving ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ttft_ms(gen, builder.build(DEFAULT_SCAFFOLD_TEXT, [], "warm-up?").ids, None)
    for s_tok in (int(x) for x in args.scaffold_tokens.split(",")):
        scaffold = sized(DEFAULT_SCAFFOLD_TEXT, EXTRA_RULE, s_tok, lambda t: len(builder.scaffold_ids(t)))
        for c_tok in (int(x) for x in args.context_tokens.split(",")):
            chunk = sized("", FILLER, c_tok, lambda t: len(builder.encode_plain(t)))
            p = builder.build(scaffold, [PromptChunk(1, 1, chunk)], "When was the pump station inspected?")
            none, cold, warm = [], [], []
            for _ in range(args.repeats):
                none.append(ttft_ms(gen, p.ids, None))
                gen.prefix_cache.clear()
                cold.append(ttft_ms(gen, p.ids, p.scaffold_ids))
                warm.append(ttft_ms(gen, p.ids, p.scaffold_ids))
            c_ms, w_ms, n_ms = (statistics.median(x) for x in (cold, warm, none))
            pred = "-"
            if model is not None:
                full = model.predict_ttft_ms(p.prompt_tokens, 0)[0]
                hit = model.predict_ttft_ms(p.prompt_tokens, p.scaffold_len)[0]
                pred = f"{full - hit:.1f}"
            print(f"| {p.scaffold_len} | {sum(p.chunk_token_counts)} | {p.prompt_tokens} | {n_ms:.1f} "
                  f"| {c_ms:.1f} | {w_ms:.1f} | {c_ms - w_ms:.1f} | {100 * (c_ms - w_ms) / c_ms:.0f} "
                  f"| {pred} |")


if __name__ == "__main__":
    main()
