"""Server-side charts for the console: matplotlib SVG, inlined in the page (no client library).

SVG text stays text (``svg.fonttype = none``) so it scales and can be read by
assistive technology, ids are salted with a constant (``svg.hashsalt``) so the
same data gives the same bytes, and the artists a reader or a test looks for
carry stable ids (``gid``): ``curve-p50``, ``curve-p95``, ``budget-line``,
``chosen-k``, ``sweep-points``, ``profile-fit``, ``profile-fresh``.
Figures are built with the object API (no pyplot state), under a lock because
matplotlib's text layout caches are shared.
"""

from __future__ import annotations

import io
import re
import threading
from typing import Any

_LOCK = threading.Lock()
_RC: dict[str, Any] = {"svg.fonttype": "none", "svg.hashsalt": "ragbudget-console", "font.size": 9.0,
       "axes.spines.top": False, "axes.spines.right": False}
# Okabe-Ito colour-blind-safe palette (Okabe & Ito, "Color Universal Design", 2008).
BLUE, ORANGE, GREEN, VERMILION, BLACK = "#0072B2", "#E69F00", "#009E73", "#D55E00", "#000000"


def _svg(fig: Any) -> str:
    """The figure as an SVG fragment for inlining (no XML declaration or DOCTYPE)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    text = re.sub(r"^<\?xml[^>]*>\s*", "", text)
    text = re.sub(r"<!DOCTYPE[^>]*>\s*", "", text)
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    return text.replace("<svg ", '<svg role="img" focusable="false" ', 1)


def curve_svg(rows: list[dict[str, Any]], *, overhead_ms: float, budget_ms: float, chosen_k: int | None,
              sweep: dict[str, Any] | None = None) -> str:
    """Predicted TTFT (p50 line, p95 dashed, band between) against k, the budget line, the chosen k,
    and the last sweep's measured medians when given.

    Args:
        rows: plan rows (``k``, ``ttft_p50_ms``, ``ttft_p95_ms``: prefill only, ms).
        overhead_ms: measured pre-prefill overhead added to both predictions, so the curve is
            TTFT from arrival, the quantity the budget bounds.
        budget_ms: the TTFT budget (ms). chosen_k: the planner's k (None: nothing fits).
        sweep: ``{"per_k": [{"k", "measured_ttft_ms_median"}], "label"}`` or None.
    """
    import matplotlib
    from matplotlib.figure import Figure

    ks = [int(r["k"]) for r in rows]
    p50 = [float(r["ttft_p50_ms"]) + overhead_ms for r in rows]
    p95 = [float(r["ttft_p95_ms"]) + overhead_ms for r in rows]
    with _LOCK, matplotlib.rc_context(_RC):  # type: ignore[arg-type]
        fig = Figure(figsize=(7.2, 3.8))
        ax = fig.add_subplot()
        ax.fill_between(ks, p50, p95, color=BLUE, alpha=0.15, linewidth=0)
        ax.plot(ks, p50, "o-", color=BLUE, ms=3, label="predicted TTFT p50", gid="curve-p50")
        ax.plot(ks, p95, "s--", color=BLUE, ms=3, label="predicted TTFT p95", gid="curve-p95")
        ax.axhline(budget_ms, color=VERMILION, ls=":", lw=1.5, label=f"budget {budget_ms:,.0f} ms",
                   gid="budget-line")
        if sweep and sweep.get("per_k"):
            pts = [(int(p["k"]), float(p["measured_ttft_ms_median"])) for p in sweep["per_k"]
                   if p.get("measured_ttft_ms_median") is not None]
            if pts:
                ax.plot([k for k, _ in pts], [m for _, m in pts], "D", color=BLACK, ms=4,
                        label=sweep.get("label") or "last sweep: measured median", gid="sweep-points")
        if chosen_k is not None and 0 <= chosen_k < len(ks):
            ax.axvline(chosen_k, color=GREEN, lw=1.2)
            ax.plot([chosen_k], [p95[chosen_k]], "o", ms=11, mfc="none", mec=GREEN, mew=2.2,
                    label=f"chosen k = {chosen_k}", gid="chosen-k")
            ax.annotate(f"k = {chosen_k}", (chosen_k, p95[chosen_k]), textcoords="offset points",
                        xytext=(6, -14), color=GREEN, fontweight="bold")
        ax.set_xlabel("k (chunks in the prompt, rank order)")
        ax.set_ylabel("TTFT from arrival (ms)")
        ax.set_xticks(ks if len(ks) <= 24 else ks[:: max(1, len(ks) // 12)])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", frameon=False)
        return _svg(fig)


def profile_svg(profile: Any) -> str | None:
    """Measured prefill time of each calibration sample against the profile's p50 prediction
    (log-log, the diagonal is a perfect prediction); fit and held-out (``fresh``) samples apart.
    None for a profile without prefill samples (a roofline prior)."""
    import matplotlib
    from matplotlib.figure import Figure

    samples = [r for r in (profile.samples or {}).get("prefill", []) if len(r) >= 4]
    if not samples:
        return None
    with _LOCK, matplotlib.rc_context(_RC):  # type: ignore[arg-type]
        fig = Figure(figsize=(4.6, 4.0))
        ax = fig.add_subplot()
        lo, hi = float("inf"), 0.0
        for role, colour, marker, gid in (("fit", BLUE, "o", "profile-fit"),
                                          ("fresh", ORANGE, "x", "profile-fresh")):
            pts = [r for r in samples if r[3] == role]
            if not pts:
                continue
            p50, _p95 = profile.predict_ttft_many([r[0] for r in pts], [r[1] for r in pts])
            measured = [float(r[2]) for r in pts]
            ax.scatter(measured, list(p50), s=12 if marker == "o" else 28, marker=marker, color=colour,
                       alpha=0.7, label=f"{role} ({len(pts)})", gid=gid)
            lo = min(lo, *measured, *map(float, p50))
            hi = max(hi, *measured, *map(float, p50))
        if hi <= 0:
            return None
        lo = max(lo * 0.8, 1e-3)
        hi *= 1.25
        ax.plot([lo, hi], [lo, hi], color=BLACK, lw=0.8, label="predicted = measured")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured prefill (ms)")
        ax.set_ylabel("predicted p50 (ms)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper left", frameon=False)
        return _svg(fig)
