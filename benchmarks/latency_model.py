"""Calibrate the prefill/decode cost model on a real model and show how well it predicts.

Runs (or, with ``--load``, reloads) a calibration of SmolLM2-135M-Instruct (fp32,
2 torch threads) through a stand-alone transformers timer, then prints the fit,
the held-out errors (leave-one-length-out MAPE; MAPE and p95 coverage on fresh
points measured in the same interleaved run but never fitted), the competing
prefill forms, the roofline prior's error, and the share of the CPU other
processes used meanwhile. Writes ``docs/latency_model.png``: measured vs
predicted TTFT against prompt tokens with the p95 band, one colour per cached
length, and the held-out error of each form.

    python -m benchmarks.latency_model --grid quick --save /tmp/latency_profile.json
    python -m benchmarks.latency_model --load /tmp/latency_profile.json   # replot only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import REPO as ROOT
from latency_model.calibration import calibrate
from latency_model.fitting import coverage, leave_one_group_out, mape
from latency_model.grid import full_grid, quick_grid
from latency_model.predictors import PREFILL_MODELS
from latency_model.profile import Profile
from latency_model.roofline import build_prior

DEFAULT_MODEL = ROOT / "ragbudget-data" / "models" / "smollm2-135m-instruct-fp32"


def default_scaffold_tokens(model_dir: Path) -> list[int]:
    """Token count of the default scaffold with this model's tokenizer (best effort)."""
    try:
        from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder
        from generation.assets import load_tokenizer
        from retrieval.tokens import HFTextTokenizer

        builder = PromptBuilder.for_tokenizer(HFTextTokenizer(load_tokenizer(model_dir), name="bench"))
        return [len(builder.scaffold_ids(DEFAULT_SCAFFOLD_TEXT))]
    except Exception as exc:  # the prompt layer may not exist yet
        print(f"scaffold size unavailable ({exc}); using 200 tokens", file=sys.stderr)
        return [200]


def wait_quiet(max_wait_s: float, threshold: float = 0.05) -> float | None:
    """Wait (up to ``max_wait_s``) until other processes use < ``threshold`` of the CPU over 3 s."""
    from latency_model.probe import cpu_snapshot, other_cpu_fraction

    deadline = time.perf_counter() + max_wait_s
    while True:
        a = cpu_snapshot()
        time.sleep(3.0)
        frac = other_cpu_fraction(a, cpu_snapshot())
        if frac is None or frac < threshold or time.perf_counter() > deadline:
            return frac
        print(f"waiting for a quiet CPU (others use {frac:.0%})", file=sys.stderr)


def rows(profile: Profile, role: str) -> np.ndarray:
    """``(N, 3)`` prefill samples ``[prompt, cached, ms]`` with this role."""
    return np.array([r[:3] for r in profile.samples["prefill"] if r[3] == role],
                    dtype=float).reshape(-1, 3)


def form_errors(fit: np.ndarray) -> dict[str, np.ndarray]:
    """Leave-one-length-out relative error (predicted / measured - 1) per form, per fit row."""
    out = {}
    n, c, y = fit[:, 0], fit[:, 1], fit[:, 2]
    for name, cls in PREFILL_MODELS.items():
        def _fp(train: np.ndarray, test: np.ndarray, cls: Any = cls) -> np.ndarray:
            return cls.fit(n[train], c[train], y[train]).predict_ms(n[test], c[test])

        out[name] = leave_one_group_out(_fp, n, n.size) / y - 1.0
    return out


def prior_report(profile: Profile, model_dir: Path, threads: int) -> dict[str, Any]:
    """The roofline prior for this CPU, scored on every measured (fit + fresh) prefill."""
    from transformers import AutoConfig

    from latency_model.probe import probe_cpu

    cfg = AutoConfig.from_pretrained(str(model_dir)).to_dict()
    probe = probe_cpu(threads)
    prior = build_prior(profile.to_dict(), cfg, peak_flops=probe["peak_flops"],
                        bandwidth_bytes_s=probe["bandwidth_bytes_s"], peaks_source=probe["source"],
                        created_at=profile.created_at)
    pts = np.vstack([rows(profile, "fit"), rows(profile, "fresh")])
    p50, p95 = prior.predict_ttft_many(pts[:, 0], pts[:, 1])
    return {"coefficients": prior.prefill_coefficients, "probe": probe["source"],
            "mape": mape(pts[:, 2], p50), "p95_coverage": coverage(pts[:, 2], p95)}


def plot(profile: Profile, errors: dict[str, np.ndarray], path: Path) -> None:
    """Two panels: TTFT vs prompt tokens (measured, p50, p95 band) and held-out error per form."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fit, fresh = rows(profile, "fit"), rows(profile, "fresh")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    top = max(fit[:, 0].max(), fresh[:, 0].max() if fresh.size else 0)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, cached in enumerate(sorted(set(fit[:, 1].astype(int)))):
        col = colours[i % len(colours)]
        sel = fit[:, 1] == cached
        ax.scatter(fit[sel, 0], fit[sel, 2], s=10, color=col, alpha=0.6,
                   label=f"measured, cached={cached}")
        fsel = fresh[:, 1] == cached
        if fsel.any():
            ax.scatter(fresh[fsel, 0], fresh[fsel, 2], s=40, marker="x", color=col,
                       label=f"fresh (held out), cached={cached}")
        n = np.linspace(cached + 1, top, 200)
        p50, p95 = profile.predict_ttft_many(n, np.full_like(n, cached))
        ax.plot(n, p50, color=col, lw=1.5, label=f"predicted p50, cached={cached}")
        ax.fill_between(n, p50, p95, color=col, alpha=0.15)
        ax.plot(n, p95, color=col, lw=0.8, ls="--")
    ax.set_xlabel("prompt tokens n")
    ax.set_ylabel("TTFT (prefill) ms")
    ax.set_title(f"{profile.prefill_model}: {profile.device_name}, {profile.dtype}, "
                 f"{profile.threads} threads\nshaded: p50..p95 band", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    for name, err in errors.items():
        lengths = np.unique(fit[:, 0])
        med = [np.median(np.abs(err[fit[:, 0] == x])) * 100 for x in lengths]
        ax2.plot(lengths, med, marker="o", label=f"{name} (LOO MAPE {100 * np.mean(np.abs(err)):.1f}%)")
    ax2.set_xscale("log")
    ax2.set_xlabel("held-out prompt length n (tokens)")
    ax2.set_ylabel("median |error| when this length is left out, %")
    ax2.set_title("leave-one-length-out error per prefill form", fontsize=9)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", choices=["quick", "full"], default="quick")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cached", type=int, nargs="*", help="cached lengths besides 0 (default: scaffold)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load", type=Path, help="reuse a saved profile JSON instead of measuring")
    ap.add_argument("--save", type=Path, help="write the profile JSON here")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "latency_model.png")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="wait up to S seconds for other processes to leave the CPU first")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)

    if args.load:
        profile = Profile.from_json(args.load.read_text())
        wall_s = None
    else:
        from benchmarks.hf_prefill_timer import HFPrefillTimer

        if args.wait_quiet:
            wait_quiet(args.wait_quiet)
        timer = HFPrefillTimer(args.model_dir, threads=args.threads)
        cached = args.cached if args.cached is not None else default_scaffold_tokens(args.model_dir)
        grid = (quick_grid if args.grid == "quick" else full_grid)(timer.context_window, cached)
        t0 = time.perf_counter()
        profile = calibrate(timer, grid=grid, seed=args.seed, progress=True)
        wall_s = time.perf_counter() - t0
        if args.save:
            args.save.write_text(profile.to_json())

    fit = rows(profile, "fit")
    errors = form_errors(fit)
    report = {
        "profile_id": profile.id, "device_name": profile.device_name, "threads": profile.threads,
        "grid": profile.calibration.get("name"), "calibration_wall_s": wall_s,
        "other_cpu_fraction": profile.calibration.get("other_cpu_fraction"),
        "contended_samples": profile.calibration.get("contended_samples"),
        "prefill_model": profile.prefill_model, "prefill_coefficients": profile.prefill_coefficients,
        "prefill_quantiles": profile.prefill_quantiles, "decode_coefficients": profile.decode_coefficients,
        "held_out": profile.held_out, "form_loo_mape": {k: float(np.mean(np.abs(v)))
                                                        for k, v in errors.items()},
        "prior": prior_report(profile, args.model_dir, profile.threads or args.threads),
    }
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot(profile, errors, args.png)
    report["png"] = str(args.png)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    h = profile.held_out
    print(f"profile {profile.id}  ({report['grid']} grid, {len(profile.samples['prefill'])} prefill "
          f"+ {len(profile.samples['decode'])} decode samples"
          + (f", {wall_s:.0f} s" if wall_s else "") + ")")
    other = report["other_cpu_fraction"]
    print(f"device   {profile.device_name}, {profile.dtype}, {profile.threads} threads; other processes "
          f"used {'n/a' if other is None else f'{other:.1%}'} of the CPU meanwhile; "
          f"{report['contended_samples']} contended calls re-measured")
    print(f"prefill  {profile.prefill_model}: " + ", ".join(
        f"{k}={v:.5g}" for k, v in profile.prefill_coefficients.items()) + " (ms)")
    print("forms    leave-one-length-out MAPE: " + ", ".join(
        f"{k} {100 * v:.2f}%" for k, v in report["form_loo_mape"].items()))
    print(f"held-out LOO MAPE {100 * h['loo_length_mape']:.2f}%; fresh points ({h['fresh_points']}): "
          f"MAPE {100 * (h['fresh_mape'] or 0):.2f}%, "
          f"p95 coverage {100 * (h['fresh_p95_coverage'] or 0):.0f}%")
    print("band     relative residual quantiles: " + ", ".join(
        f"{k} {v:+.3f}" for k, v in profile.prefill_quantiles.items()))
    print("decode   " + ", ".join(f"{k}={v:.5g}" for k, v in profile.decode_coefficients.items())
          + f" (ms); LOO-context MAPE {100 * (h.get('decode_loo_context_mape') or 0):.2f}%")
    pr = report["prior"]
    print(f"prior    roofline ({pr['probe']}): MAPE {100 * pr['mape']:.0f}% on all measured points, "
          f"p95 covers {100 * pr['p95_coverage']:.0f}%")
    print(f"plot     {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
