"""``python -m benchmarks.load --hog``: p95 coverage of the prefill prediction once a CPU hog starts."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import append_jsonl
from benchmarks.load_http import Server, build, set_arm


def hog(args: argparse.Namespace) -> int:
    """The CPU-hog coverage run (``--hog``; see ``benchmarks/load.py``'s docstring).

    ``args.warmup`` answers on the machine as it is, then one busy process (a pure-Python loop,
    one core) and ``args.after`` answers one at a time (``args.budget`` ms, 8 new tokens). Per
    answer: measured prefill (ms, model granted to first token) against the planned p95
    prefill, the correction learned from answers alone, and the fitted profile alone. Appends
    one ``kind: hog`` row (coverage per block of answers after the hog started: 1, 2-5, 6-10,
    1-10, 11-20, 1-20, 21-40; every answer's row) to ``args.out``
    and prints the summary; returns 0.
    """
    import httpx

    services, app, questions = build()
    pipeline = app.state.pipeline
    set_arm(pipeline, "on")
    profile = pipeline.profile()
    pipeline.bands.corrections.reset()
    correction = pipeline.bands.corrections.get(profile.id)
    server = Server(app)
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    busy: subprocess.Popen[bytes] | None = None
    try:
        with httpx.Client() as client:
            for i in range(args.warmup + args.after):
                if i == args.warmup:
                    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    time.sleep(1.0)
                q = questions[rng.randrange(len(questions))]
                # What the correction learned from answers alone (no live speed), as it stood
                # when this request was planned: the on-answers arm's band for the same answer.
                answers_state = correction.state(None, False)
                r = client.post(f"{server.url}/v1/answer", timeout=600, json={
                    "question": q, "ttft_budget_ms": args.budget, "max_new_tokens": 8}).json()
                p, t, tok = r["predicted"], r["timings"], r["tokens"]
                corrected_p95 = p["ttft_p95_ms"] - p["overhead_ms"]  # the plan's prefill p95
                fitted_p50, fitted_p95 = profile.predict_ttft_ms(tok["prompt"], tok["cached"])
                answers_p95 = float(correction.apply([fitted_p50], [fitted_p95], answers_state)[1][0])
                row = {"i": i, "hog": busy is not None, "prefill_ms": t["prefill_ms"],
                       "corrected_p95": corrected_p95, "answers_p95": answers_p95, "fitted_p95": fitted_p95,
                       "fitted_p50": fitted_p50,
                       "factor": p["correction_factor"], "mult": p["p95_multiplier"],
                       "speed": p.get("machine_speed"), "k": r["chosen_k"]}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        if busy is not None:
            busy.terminate()
            busy.wait(10)
        server.stop()
        services.close()

    out = {"kind": "hog", "profile": profile.id, **summarise(rows, args.warmup), "rows": rows}
    append_jsonl(args.out, [out])
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))
    return 0


#: Blocks of answers after the hog started, ``[lo, hi)`` (0-based), the summary reports.
BLOCKS = {"after_1": (0, 1), "after_2_5": (1, 5), "after_6_10": (5, 10), "after_1_10": (0, 10),
          "after_11_20": (10, 20), "after_1_20": (0, 20), "after_21_40": (20, 40)}


def summarise(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The hog run's summary from its per-answer rows (``hog`` False for the ``warmup`` answers
    before it started, True after).

    Returns ``warmup``: the corrected p95's coverage of the measured prefill before the hog;
    per block of :data:`BLOCKS`: the coverage (share of answers with ``prefill_ms <= p95``) of
    the ``corrected``, ``answers`` (correction from answers alone) and ``fitted`` p95, None
    for an empty block, and ``[min, max]`` of the machine ``speed`` the plans read and of
    their measured prefill / fitted p50; ``prefill_over_fitted_p50``: the median of measured prefill / fitted
    p50 prefill before (``warmup``) and after (``hog``) the hog started, how much slower the
    machine ran than the profile said; ``k``: ``[min, max]`` chosen k before and after;
    ``factor_end``: the last answer's correction factor.
    """
    def cov(rs: list[dict[str, Any]], key: str) -> float | None:
        rs = [r for r in rs if r["prefill_ms"] is not None]
        return sum(1 for r in rs if r["prefill_ms"] <= r[key]) / len(rs) if rs else None

    def ratio(rs: list[dict[str, Any]]) -> float | None:
        xs = [r["prefill_ms"] / r["fitted_p50"] for r in rs
              if r["prefill_ms"] is not None and r["fitted_p50"] > 0]
        return round(statistics.median(xs), 3) if xs else None

    def k_range(rs: list[dict[str, Any]]) -> list[int] | None:
        ks = [r["k"] for r in rs]
        return [min(ks), max(ks)] if ks else None

    def span(xs: list[float]) -> list[float] | None:
        return [round(min(xs), 2), round(max(xs), 2)] if xs else None

    def block(rs: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {k: cov(rs, f"{k}_p95") for k in ("corrected", "answers", "fitted")}
        # The live machine speed each plan read, against how much slower its prefill ran.
        out["speed"] = span([r["speed"] for r in rs if r.get("speed") is not None])
        out["prefill_over_fitted_p50"] = span([r["prefill_ms"] / r["fitted_p50"] for r in rs
                                               if r["prefill_ms"] is not None and r["fitted_p50"] > 0])
        return out

    before, after = rows[:warmup], [r for r in rows if r["hog"]]
    return {"warmup": cov(before, "corrected_p95"),
            **{name: block(after[lo:hi]) for name, (lo, hi) in BLOCKS.items()},
            "prefill_over_fitted_p50": {"warmup": ratio(before), "hog": ratio(after)},
            "k": {"warmup": k_range(before), "hog": k_range(after)},
            "factor_end": after[-1]["factor"] if after else None}


def hog_report(rows: list[dict[str, Any]]) -> str:
    """``python -m benchmarks.load --report`` on a hog run's file: one JSON summary per ``kind: hog`` row, its
    :func:`summarise` recomputed from the stored per-answer rows."""
    return "\n".join(json.dumps({"profile": r.get("profile"), **summarise(r["rows"], sum(
        1 for a in r["rows"] if not a["hog"]))}) for r in rows if r.get("kind") == "hog")
