"""Where the p95 band's width comes from: a fleet run's served prefills replayed offline.

Reads a results file of :mod:`benchmarks.fleet` (its ``rows``: per answered request the plan's
predicted TTFT p50/p95, the wait and overhead the plan priced, the correction factor in force
and the measured prefill, ms) and, per engine, in the order the answers finished:

* recovers each answer's fitted prefill p50 (``(pred_p50 - plan_overhead) / factor``) and its
  fitted p95 (the profile's band ``max(p50 x R, p50 + A95)``, with ``R`` and ``A95`` read from
  the answers planned before any correction applied: factor 1, no multiplier);
* the served residual: measured prefill / fitted p50, its median and 95th percentile (numpy
  linear) per prompt size (k = 0: the question and scaffold only; k >= 1);
* replays the answers through :class:`latency_model.correction.OnlineCorrection` under the
  earlier rule (``residual_band=False``: the conformal multiplier of the pooled window, floored
  at the fitted spread without a machine speed; the default) and the residual band
  (``residual_band=True``), each answer planned with the state before it and learned after it:
  the share of measured prefills at or under the corrected p95 and the corrected p95/p50 of
  each size;
* with ``--variants``, the candidate rules of :data:`VARIANTS` as well (Mondrian classes by k
  or by doubling of the fitted p50, each with its own window, with or without the drift guard;
  weighted conformal with geometric decay, pooled or per class), printed as one table.

No model runs; the figures are as exact as the results file (the fitted p95 is rebuilt, not
read). ::

    python -m benchmarks.band_replay benchmarks/results/fleet-2.json --variants \\
        --json benchmarks/results/band-replay-fleet-2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from latency_model.correction import GROUP_MIN, OnlineCorrection
from latency_model.residual_band import class_multipliers, mondrian_multiplier, size_class, weighted_conformal

#: The variants :func:`replay_variants` compares beside the two rules of the correction: name ->
#: (class key: ``"k"`` the answer's size class k = 0 / k >= 1, ``"log2"`` :func:`size_class` of
#: its fitted p50, ``None`` pooled; answers kept per class; drift guard; weight decay, ``None``:
#: split-conformal rank).
VARIANTS: dict[str, tuple[str | None, int, bool, float | None]] = {
    "mondrian-k-40": ("k", 40, False, None),
    "mondrian-k-40-guard": ("k", 40, True, None),
    "mondrian-k-80": ("k", 80, False, None),
    "mondrian-k-80-guard": ("k", 80, True, None),
    "mondrian-log2-40": ("log2", 40, False, None),
    "mondrian-log2-40-guard": ("log2", 40, True, None),
    "mondrian-log2-80-guard": ("log2", 80, True, None),
    "weighted-0.99": (None, 200, False, 0.99),
    "weighted-0.95": (None, 200, False, 0.95),
    "weighted-k-0.99": ("k", 200, False, 0.99),
    "weighted-k-0.97": ("k", 200, False, 0.97),
    "weighted-k-0.995": ("k", 200, False, 0.995),
    "weighted-0.995": (None, 200, False, 0.995),
    "weighted-log2-0.99": ("log2", 200, False, 0.99),
}


def fitted_band(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """``(R, A95 ms)`` of an engine's fitted band, from its answers planned uncorrected (factor 1,
    no multiplier): ``A95`` the least p95 - p50, ``R`` the largest p95/p50 of those above it by
    more than 5 ms (else the least p95/p50). ``(1, 0)`` when there are none."""
    pts = [(r["pred_p50_ms"] - r["plan_overhead_ms"], r["pred_p95_ms"] - r["plan_overhead_ms"])
           for r in rows if r["correction_factor"] == 1.0 and r["p95_multiplier"] is None]
    if not pts:
        return 1.0, 0.0
    a95 = min(p95 - p50 for p50, p95 in pts)
    wide = [p95 / p50 for p50, p95 in pts if p95 - p50 > a95 + 5.0]
    return (max(wide) if wide else min(p95 / p50 for p50, p95 in pts)), a95


def size_of(row: dict[str, Any]) -> str:
    """``"k0"`` or ``"k1+"``: the prompt size class of an answer."""
    return "k0" if row["k"] == 0 else "k1+"


def replay(rows: list[dict[str, Any]], residual_band: bool) -> dict[str, Any]:
    """One engine's answers, in order, through a fresh correction under one rule: per size class
    and in all, answers, share covered by the corrected p95 and the median corrected p95/p50 (over
    every answer, and over those planned with at least GROUP_MIN answers learned)."""
    r95, a95 = fitted_band(rows)
    c = OnlineCorrection("replay", window=40, min_samples=5, residual_band=residual_band)
    out: dict[str, list[tuple[bool, float, bool]]] = {"k0": [], "k1+": [], "all": []}
    for r in rows:
        fit50 = (r["pred_p50_ms"] - r["plan_overhead_ms"]) / r["correction_factor"]
        fit95 = max(fit50 * r95, fit50 + a95)
        st = c.state()
        c50, c95 = c.apply([fit50], [fit95], st)
        item = (r["prefill_ms"] <= c95[0], float(c95[0] / c50[0]), st.n >= GROUP_MIN)
        out[size_of(r)].append(item)
        out["all"].append(item)
        c.observe(fit50, r["prefill_ms"])
    return {name: _cell(items) for name, items in out.items()}


def _cell(items: list[tuple[bool, float, bool]]) -> dict[str, Any]:
    late = [i for i in items if i[2]]
    return {"answers": len(items), "covered": float(np.mean([i[0] for i in items])) if items else None,
            "spread_median": float(np.median([i[1] for i in items])) if items else None,
            "answers_after_rank": len(late),
            "covered_after_rank": float(np.mean([i[0] for i in late])) if late else None,
            "spread_median_after_rank": float(np.median([i[1] for i in late])) if late else None}


def replay_variants(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One engine's answers, in order, under every rule of :data:`VARIANTS` (cells as
    :func:`replay`). The factor (p50) is the correction's (median of the newest 40 ratios); each
    variant replaces the multiplier once its class holds a bound (before that, and for a class
    whose weights fall short of 0.95, the earlier rule's p95 applies). Scores are every earlier
    answer's ratio over the factor in force, as the correction computes them."""
    r95, a95 = fitted_band(rows)
    c = OnlineCorrection("replay", window=40, min_samples=5, residual_band=False)
    hist: list[tuple[float, float, Any]] = []  # (fitted p50, ratio, class keys) oldest first
    out = {name: {"k0": [], "k1+": [], "all": []} for name in VARIANTS}
    for r in rows:
        fit50 = (r["pred_p50_ms"] - r["plan_overhead_ms"]) / r["correction_factor"]
        fit95 = max(fit50 * r95, fit50 + a95)
        st = c.state()
        c50, c95 = c.apply([fit50], [fit95], st)
        keys = {"k": size_of(r), "log2": size_class(fit50), None: 0}
        ratios = np.array([h[1] for h in hist])
        for name, (key, keep, guard, decay) in VARIANTS.items():
            p95 = float(c95[0])
            mult: float | None = None
            if st.active and key == "log2" and len(hist) >= GROUP_MIN:
                got = class_multipliers([(h[0], q / st.factor) for h, q in zip(hist, ratios, strict=True)],
                                        [fit50], keep, guard, decay)[0]
                mult = None if np.isnan(got) else float(got)
            elif st.active and key != "log2":
                mine = ratios[[i for i, h in enumerate(hist) if h[2][key] == keys[key]]][-keep:] / st.factor
                if mine.size:
                    mult = (mondrian_multiplier(mine, guard) if decay is None
                            else weighted_conformal(mine, decay))
            if mult is not None:
                p95 = float(c50[0]) * min(max(mult, 1.0), c.max_multiplier)
            item = (r["prefill_ms"] <= p95, p95 / float(c50[0]), st.n >= GROUP_MIN)
            out[name][size_of(r)].append(item)
            out[name]["all"].append(item)
        c.observe(fit50, r["prefill_ms"])
        hist.append((fit50, r["prefill_ms"] / fit50, keys))
    return {name: {size: _cell(items) for size, items in cells.items()} for name, cells in out.items()}


def residual_spread(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per size class: answers, median, 95th percentile and their ratio of measured prefill /
    fitted p50, and the median fitted p95/p50 of those answers."""
    r95, a95 = fitted_band(rows)
    out: dict[str, Any] = {}
    for name in ("k0", "k1+"):
        sel = [r for r in rows if size_of(r) == name]
        if not sel:
            continue
        fit50 = np.array([(r["pred_p50_ms"] - r["plan_overhead_ms"]) / r["correction_factor"] for r in sel])
        ratio = np.array([r["prefill_ms"] for r in sel]) / fit50
        med, q95 = float(np.median(ratio)), float(np.quantile(ratio, 0.95))
        fitted = np.maximum(fit50 * r95, fit50 + a95) / fit50
        tokens = float(np.median([r["computed_tokens"] for r in sel]))
        out[name] = {"answers": len(sel), "computed_tokens_median": tokens,
                     "fitted_p50_ms_median": float(np.median(fit50)), "ratio_median": med,
                     "ratio_p95": q95, "served_spread": q95 / med,
                     "fitted_spread_median": float(np.median(fitted))}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="a benchmarks.fleet results file")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--variants", action="store_true",
                    help="also replay every rule of VARIANTS and print one table of them")
    args = ap.parse_args(argv)
    data = json.loads(args.results.read_text())
    rows = [r for r in data["rows"] if r.get("phase") == "arms" and r.get("status") == "ok"
            and r.get("prefill_ms") and r.get("pred_p50_ms") is not None]
    result: dict[str, Any] = {"source": str(args.results), "source_machine": data.get("machine"),
                              "source_started_utc": data.get("started_utc"), "engines": {}}
    for eng in sorted({r["engine"] for r in rows}):
        mine = [r for r in rows if r["engine"] == eng]
        r95, a95 = fitted_band(mine)
        result["engines"][eng] = {"fitted_R": r95, "fitted_A95_ms": a95, "served": residual_spread(mine),
                                  "fitted_floor_rule": replay(mine, False),
                                  "residual_band": replay(mine, True)}
        if args.variants:
            result["engines"][eng]["variants"] = replay_variants(mine)
    for eng, e in result["engines"].items():
        print(f"engine {eng}: fitted band max(p50 x {e['fitted_R']:.2f}, p50 + {e['fitted_A95_ms']:.0f} ms)")
        for name, s in e["served"].items():
            print(f"  {name}: {s['answers']} answers, ~{s['computed_tokens_median']:.0f} computed tokens, "
                  f"measured/fitted p50 median {s['ratio_median']:.2f} p95 {s['ratio_p95']:.2f} "
                  f"(served spread {s['served_spread']:.2f}, fitted {s['fitted_spread_median']:.2f})")
        for rule in ("fitted_floor_rule", "residual_band"):
            for name in ("k0", "k1+", "all"):
                s = e[rule][name]
                if s["answers"]:
                    late = s["covered_after_rank"]
                    late_text = "-" if late is None else format(late, ".1%")
                    spread = s["spread_median_after_rank"] or float("nan")
                    print(f"  {rule:17s} {name:4s}: covered {s['covered']:.1%} of {s['answers']}, p95/p50 "
                          f"median {s['spread_median']:.2f}; after rank: covered {late_text}"
                          f" of {s['answers_after_rank']}, p95/p50 {spread:.2f}")
    if args.variants:
        print("variant: per engine and size, covered after rank (answers), p95/p50 median after rank")
        for rule in ("fitted_floor_rule", "residual_band", *VARIANTS):
            cells = []
            for eng, e in result["engines"].items():
                got = e[rule] if rule in e else e["variants"][rule]
                for name in ("k0", "k1+"):
                    s = got[name]
                    if s["answers_after_rank"]:
                        cells.append(f"{eng} {name} {s['covered_after_rank']:.1%} ({s['answers_after_rank']})"
                                     f" {s['spread_median_after_rank']:.2f}")
            print(f"  {rule:22s} " + " | ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
