"""Warm vs cold scaffold TTFT on the local generator, against the latency model's predicted saving.

For each (scaffold tokens, context tokens) the same prompt is prefilled with
``max_new_tokens=1``: cold (prefix cache emptied, so the scaffold is computed and
stored), warm (scaffold KV copied from the cache) and with no prefix at all.
TTFT here is the generator's own ``prefill_ms`` (prefill start to first token),
median of ``--repeats`` interleaved runs. The predicted saving is
``p50(n, 0) - p50(n, scaffold)`` from ``--profile`` (a saved profile JSON) or,
without one, the roofline prior (labelled ``prior``); ``-`` when neither loads.

    python -m benchmarks.prefix_cache --threads 1 --repeats 3

``--engine`` measures the engine path instead, through ``LocalGenerator.prefill_ms``
(one answer alone, cache copy + chunked prefill + first token): at each prompt
length (``--lengths``) a cache hit on the app's scaffold (``(n, P)``), a miss on
it (``(n, 0, prefix_tokens=P)``: the scaffold in its own chunk, then the rest, as
an answer without a cached scaffold runs) and, with ``--plain``, a prompt without
a scaffold (``(n, 0)``), interleaved: every repeat visits the lengths in a rotated
order and the paths in a rotated order, back to back. Medians over ``--repeats``;
the saving is the median of the paired differences, and again read step by step
(``step_saving``: the miss's scaffold steps plus the difference outside steps, the
identical later steps left out, so their repeat noise does not drown the saving). The predicted
saving is ``p50(n, 0, prefix=P) - p50(n, P)`` from ``--profile``, or from a quick
calibration run in the same process first (``--calibrate``: the same
``latency_model.calibration.calibrate`` on the same ``latency_model.grid.quick_grid`` as
``ragbudget calibrate --quick``, scaffold ``P``; ``--save-profile`` keeps it).

    python -m benchmarks.prefix_cache --engine --calibrate --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder, PromptChunk
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
    answer = gen.stream(ids, cached_prefix_ids=prefix, params=GenParams(max_new_tokens=1))
    list(answer)
    assert answer.stats is not None
    return answer.stats.prefill_ms


def machine() -> dict[str, Any]:
    """CPU model (``/proc/cpuinfo``), load averages and the UTC time now."""
    cpu = "?"
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    return {"cpu": cpu, "loadavg": list(os.getloadavg()),
            "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def step_saving(scaffold: int, miss: list[Any], hit: list[Any], miss_ms: float,
                hit_ms: float) -> float | None:
    """What one cache hit saved, read step by step from a paired miss and hit, ms; None when
    the two did not run the same steps after the scaffold.

    A miss runs the scaffold in its own chunk(s) (every segment starting before ``scaffold``),
    then exactly the steps a hit runs (same tokens at the same positions, attending to the same
    keys): the saving is the miss's scaffold steps plus the difference in time outside steps
    (cache copy on a hit; storing the scaffold's KV on a miss). The identical later steps are
    left out, so their repeat noise (hundreds of ms at 2000 tokens on a shared 2-core VM) does
    not drown a ~200 ms saving; their expected difference is zero because their shapes are the
    same, which this checks (``StepRecord.segments`` and ``logit_rows``)."""
    cut = next((i for i, st in enumerate(miss) if any(start >= scaffold for _, start in st.segments)),
               len(miss))
    head, rest = miss[:cut], miss[cut:]
    if [(st.segments, st.logit_rows) for st in rest] != [(st.segments, st.logit_rows) for st in hit]:
        return None
    outside_miss = miss_ms - sum(st.ms for st in miss)
    outside_hit = hit_ms - sum(st.ms for st in hit)
    return sum(st.ms for st in head) + outside_miss - outside_hit


def engine_rows(gen: LocalGenerator, lengths: list[int], scaffold: int, repeats: int,
                model: Any, plain: bool = False) -> list[dict[str, Any]]:
    """Hit / miss (/ no-scaffold with ``plain``) prefill medians (ms) per length, interleaved,
    with the predicted saving of a hit over a miss (``model``: a profile, or None).

    ``saving_ms`` is the median of the paired differences ``miss - hit`` (the two measured
    back to back in each repeat, so a slow drift of the machine cancels), with their
    quartiles; ``never_slower`` is that median ``>= 0``."""
    paths = {"hit": (scaffold, None), "miss": (0, scaffold)}
    if plain:
        paths["plain"] = (0, None)
    times: dict[tuple[int, str], list[float]] = {(n, k): [] for n in lengths for k in paths}
    steps: dict[tuple[int, str], list[list[Any]]] = {(n, k): [] for n in lengths for k in paths}
    names = list(paths)
    for n in lengths:  # warm-up: one of each path per length (first-touch allocations)
        for k in names:
            gen.prefill_ms(n, paths[k][0], prefix_tokens=paths[k][1])
    for r in range(repeats):
        order = lengths[r % len(lengths):] + lengths[:r % len(lengths)]
        for i, n in enumerate(order):
            rot = (r + i) % len(names)
            for k in names[rot:] + names[:rot]:
                log: list[Any] = []
                times[(n, k)].append(gen.prefill_ms(n, paths[k][0], prefix_tokens=paths[k][1], steps=log))
                steps[(n, k)].append(log)
    rows = []
    for n in lengths:
        med = {k: statistics.median(times[(n, k)]) for k in names}
        diffs = [m - h for m, h in zip(times[(n, "miss")], times[(n, "hit")], strict=True)]
        q1, _, q3 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else (diffs[0],) * 3
        row: dict[str, Any] = {"prompt_tokens": n, "scaffold_tokens": scaffold,
                               **{f"{k}_ms": med[k] for k in names},
                               "samples": {k: times[(n, k)] for k in names},
                               "saving_ms": statistics.median(diffs), "saving_q1_ms": q1, "saving_q3_ms": q3,
                               "never_slower": statistics.median(diffs) >= 0}
        by_steps = [step_saving(scaffold, m, h, mt, ht) for m, h, mt, ht in
                    zip(steps[(n, "miss")], steps[(n, "hit")], times[(n, "miss")], times[(n, "hit")],
                        strict=True)]
        good = [x for x in by_steps if x is not None]
        if good:
            sq1, _, sq3 = statistics.quantiles(good, n=4) if len(good) > 1 else (good[0],) * 3
            row.update({"step_saving_ms": statistics.median(good), "step_saving_q1_ms": sq1,
                        "step_saving_q3_ms": sq3, "step_saving_pairs": len(good),
                        "step_saving_samples": good})
        if plain:
            row["saving_vs_plain_ms"] = med["plain"] - med["hit"]
        if model is not None:
            miss = model.predict_ttft_ms(n, 0, scaffold)[0]
            hit = model.predict_ttft_ms(n, scaffold)[0]
            row["predicted_saving_ms"] = miss - hit
            row["predicted_hit_ms"], row["predicted_miss_ms"] = hit, miss
            row["saving_error"] = (miss - hit) / row["saving_ms"] - 1.0 if row["saving_ms"] > 0 else None
            if row.get("step_saving_ms", 0) > 0:
                row["step_saving_error"] = (miss - hit) / row["step_saving_ms"] - 1.0
        rows.append(row)
    return rows


def engine_main(args: argparse.Namespace, gen: LocalGenerator, builder: PromptBuilder) -> None:
    scaffold = args.scaffold or len(builder.scaffold_ids(DEFAULT_SCAFFOLD_TEXT))
    before = machine()
    model, source = None, "-"
    if args.profile:
        model, source = predictor(args, gen)
    elif args.calibrate:
        from latency_model.calibration import calibrate
        from latency_model.grid import engine_chunk_tokens, quick_grid

        grid = quick_grid(gen.context_window, [scaffold], engine_chunk_tokens(dict(gen.identity)))
        t0 = time.perf_counter()
        model = calibrate(gen, grid=grid, seed=args.seed, progress=False)
        source = f"quick calibration in this run ({time.perf_counter() - t0:.0f} s)"
        if args.save_profile:
            Path(args.save_profile).write_text(model.to_json())
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = engine_rows(gen, lengths, scaffold, args.repeats, model, args.plain)
    after = machine()
    ident = gen.identity
    print(f"# {ident['model_id']} {ident['device_name']} {ident['dtype']} threads={ident['threads']} "
          f"chunk={gen.prefill_chunk} scaffold={scaffold} repeats={args.repeats} prediction={source}")
    print(f"# start {before['utc']} UTC load {before['loadavg']}; "
          f"end {after['utc']} UTC load {after['loadavg']}")
    if model is not None and hasattr(model, "prefill_model"):
        print(f"# profile {model.id[:19]} form {model.prefill_model} {model.prefill_coefficients} "
              f"comparison {model.form_comparison}")
    print("| prompt | hit ms | miss ms | saving ms (median of paired miss - hit) | quartiles ms "
          "| saving from steps ms | quartiles ms | predicted saving ms | error vs paired | error vs steps |"
          + (" no scaffold ms |" if args.plain else ""))
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if args.plain else ""))

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.1f} %"

    for r in rows:
        steps = (f"{r['step_saving_ms']:.1f} | {r['step_saving_q1_ms']:.0f} .. {r['step_saving_q3_ms']:.0f}"
                 if "step_saving_ms" in r else "- | -")
        print(f"| {r['prompt_tokens']} | {r['hit_ms']:.1f} | {r['miss_ms']:.1f} | {r['saving_ms']:.1f} "
              f"| {r['saving_q1_ms']:.0f} .. {r['saving_q3_ms']:.0f} | {steps} "
              f"| {r.get('predicted_saving_ms', float('nan')):.1f} "
              f"| {pct(r.get('saving_error'))} | {pct(r.get('step_saving_error'))} |"
              + (f" {r['plain_ms']:.1f} |" if args.plain else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "identity": ident, "before": before, "after": after, "prediction": source,
            "profile": (None if model is None or not hasattr(model, "to_json")
                        else json.loads(model.to_json())),
            "rows": rows}, indent=1))


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
    ap.add_argument("--engine", action="store_true", help="hit/miss/no-scaffold through prefill_ms")
    ap.add_argument("--lengths", default="100,200,300,500,700,1100,1500,2000")
    ap.add_argument("--scaffold", type=int, default=0, help="scaffold tokens (default: the app's)")
    ap.add_argument("--calibrate", action="store_true", help="fit a quick profile first (--engine)")
    ap.add_argument("--plain", action="store_true", help="also time the prompt without a scaffold (--engine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-profile", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from generation.assets import ensure_packaged_generator

    model_dir = Path(args.model_dir) if args.model_dir else ensure_packaged_generator(Path(args.data_dir))
    gen = LocalGenerator(model_dir, device=args.device, threads=args.threads)
    builder = PromptBuilder.for_generator(gen)
    if args.engine:
        engine_main(args, gen, builder)
        return
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
