"""How well the batch model predicts the prefill of answers planned beside a running batch.

Reads the answer rows of a load run (``benchmarks/load.py``: the grid's ``answer`` rows and
the rows inside ``batching`` cells) whose plan was made beside a batch (``batch`` is set:
the answer's ``predicted.batch``, the engine's running answers and prefills ahead when k was
chosen), and compares, on the same answers, the measured prefill (model granted to the
first token) against the uncorrected batch-aware p50 of three batch models:

* ``replay``: the engine's packing replayed (:func:`latency_model.step_model.batched_step_shapes`
  at ``--step-budget``): chunks of several answers share a step within the step token
  budget, a decoder leaves the batch when its decode steps left run out, an answer ahead
  decodes ``max_new_tokens - 1`` steps after its prefill;
* ``one chunk a step``: the same, but every prefill chunk takes a step of its own;
* ``before``: one chunk a step and every decoder stays for the whole prefill (what planning
  did until 2026-12-02).

An answer waiting for the engine is shown from after its scaffold when the prefix cache holds
it, in every model alike (the batch is read back as the run recorded it).
The fitted profile's prediction alone is the same for both, so the base is read back from
the row: ``prefill_p50_ms / correction_factor`` (the plan's corrected p50 at the chosen k)
minus the batch term the run planned with. Both ratios ``measured / predicted`` are divided
by the machine speed of the plan where the row has one, so a machine slower than at
calibration does not count as model error. Prints, per model: answers, median ratio,
10th / 90th percentile, and MAPE; ratios are paired on the same answers, one run.

    python -m benchmarks.batch_model RUN.jsonl --profile PROFILE.json [--planned MODEL]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from generation.engine.messages import Decoding, Prefilling
from latency_model.profile import Profile
from latency_model.step_model import predict_batched_ttft_ms


def rows_of(path: Path) -> list[dict[str, Any]]:
    """Answered rows with a batch, from a load JSONL (grid answers and batching cells' rows)."""
    out: list[dict[str, Any]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        found = rec.get("rows", [rec]) if rec.get("kind") in ("batching", "answer") else []
        out += [r for r in found if r.get("status") == 200 and r.get("batch") and r.get("prefill_ms")
                and r.get("prefill_p50_ms") and r.get("prompt_tokens")]
    return out


MODELS = ("replay", "one chunk a step", "before")


def extra_ms(profile: Profile, row: dict[str, Any], model: str, step_budget: int) -> float:
    """p50 ms the row's batch adds to its prefill, under one of :data:`MODELS`."""
    fit = profile.step_fit
    assert fit is not None
    chunk = int(profile.prefill_chunk_tokens or 256)
    prompt, cached = int(row["prompt_tokens"]), int(row.get("cached_tokens") or 0)
    exits = model != "before"
    decoding = [Decoding(c, left if exits else None) for c, left in row["batch"]["decoding"]]
    ahead = [Prefilling(t, pos, m if exits else None) for t, pos, m in row["batch"]["prefilling"]]
    kw: dict[str, Any] = dict(prompt_tokens=prompt, cached_tokens=cached, prefix_tokens=cached,
                              chunk_tokens=chunk,
                              step_token_budget=step_budget if model == "replay" else None)
    alone = predict_batched_ttft_ms(fit, decode_contexts=(), **kw)[0]
    batch = predict_batched_ttft_ms(fit, decode_contexts=decoding, prefills_ahead=ahead, **kw)[0]
    return max(batch - alone, 0.0)


def compare(profile: Profile, rows: list[dict[str, Any]], planned: str,
            step_budget: int) -> dict[str, dict[str, float]]:
    """Per model (:data:`MODELS`): answers, median, q10, q90 of measured / predicted
    (speed-normalised) and MAPE, on the same rows; ``planned``: the model the run planned with
    (its batch term is taken out of the row's p50 to get the base)."""
    got: dict[str, list[float]] = {m: [] for m in MODELS}
    for r in rows:
        factor = float(r.get("correction_factor") or 1.0)
        base = float(r["prefill_p50_ms"]) / factor - extra_ms(profile, r, planned, step_budget)
        speed = float(r.get("machine_speed") or 1.0)
        for name in MODELS:
            predicted = (base + extra_ms(profile, r, name, step_budget)) * speed
            got[name].append(float(r["prefill_ms"]) / predicted)
    out: dict[str, dict[str, float]] = {}
    for name, ratios in got.items():
        a = np.asarray(ratios, dtype=np.float64)
        out[name] = {"answers": float(a.size), "median": float(np.median(a)),
                     "q10": float(np.quantile(a, 0.1)), "q90": float(np.quantile(a, 0.9)),
                     "mape": float(np.mean(np.abs(a - 1.0)) * 100.0)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 epilog="Models: replay = the engine's packing at --step-budget, decoders "
                                        "leave at max_new_tokens; 'one chunk a step' = the same without "
                                        "sharing steps; before = one chunk a step, decoders never leave. "
                                        "Only answers whose rows carry predicted.batch (runs from "
                                        "2026-12-02 on) are compared.")
    ap.add_argument("runs", nargs="+", type=Path, help="load.py JSONL files (grid or --batching)")
    ap.add_argument("--profile", type=Path, required=True, help="the run's profile JSON")
    ap.add_argument("--planned", choices=MODELS, default="replay",
                    help="the batch model the run planned with (its batch term is taken out of "
                         "each row's p50 to get the base prediction)")
    ap.add_argument("--step-budget", type=int, default=256, help="the engine's step token budget")
    args = ap.parse_args(argv)
    missing = [str(p) for p in [args.profile, *args.runs] if not p.is_file()]
    if missing:
        print(f"no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    profile = Profile.from_json(args.profile.read_bytes())
    if profile.step_fit is None:
        print("the profile has no mixed-step model", file=sys.stderr)
        return 2
    rows = [r for path in args.runs for r in rows_of(path)]
    if not rows:
        print("no answered rows planned beside a batch (rows need predicted.batch)", file=sys.stderr)
        return 2
    print("| batch model | answers | measured/predicted median | q10 | q90 | MAPE % |")
    print("|---|---|---|---|---|---|")
    for name, s in compare(profile, rows, args.planned, args.step_budget).items():
        print(f"| {name} | {int(s['answers'])} | {s['median']:.3f} | {s['q10']:.3f} | {s['q90']:.3f} "
              f"| {s['mape']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
