"""Tables of ``python -m benchmarks.load`` runs: read its jsonl rows, summarise cells, print markdown.

Kept apart from the runner so a finished run's ``--out`` can be reported (``python -m
benchmarks.load --out FILE --report``) and the figures quoted in docs/benchmarks.md
recomputed from benchmarks/results/ without loading any model. Row fields are those
``benchmarks/load.py`` writes (one answer a line; see its module docstring).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import quantile_or_none

#: The grid's arms (``python -m benchmarks.load --arms``) and the ``--batching`` arms.
ARMS = ("on", "on-answers", "on-greedy", "on-floor", "off")
BATCH_ARMS = ("batched", "serial")


def binomial_tail(n: int, at_least: int, p: float) -> float:
    """``P(X >= at_least)`` for ``X ~ Binomial(n, p)``, exact (sum of ``comb(n, i) p^i (1-p)^(n-i)``).

    Raises ValueError for ``n < 0`` or ``p`` outside ``[0, 1]``.
    """
    if n < 0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"need n >= 0 and 0 <= p <= 1, got n={n}, p={p}")
    return math.fsum(math.comb(n, i) * p ** i * (1.0 - p) ** (n - i) for i in range(max(at_least, 0), n + 1))


def short_cell_odds(sizes: list[int], coverage: float = 0.95) -> float:
    """Expected number of cells under ``coverage`` within budget when every answer is within
    budget independently with probability exactly ``coverage``: the sum over cells of
    ``P(misses > floor((1 - coverage) n))``. A planner whose p95 is exactly right leaves this
    many cells short of a ">= 95 % in every cell" goal by chance alone (20 answers a cell:
    0.26 per cell; a cell's goal then allows one miss)."""
    return math.fsum(binomial_tail(n, math.floor((1.0 - coverage) * n + 1e-9) + 1, 1.0 - coverage)
                     for n in sizes)


def summarise(rows: list[dict[str, Any]], budget: float) -> dict[str, Any]:
    """The per-cell figures (see the module docstring)."""
    answered = [r for r in rows if r["status"] == 200]
    rejected = [r for r in rows if r["status"] == 503]
    ttft = [r["ttft_ms"] for r in answered if r.get("ttft_ms") is not None]
    queue = [r["queue_ms"] for r in answered if r.get("queue_ms") is not None]
    return {"requests": len(rows), "answered": len(answered),
            "within": (sum(1 for r in answered if r["within"]) / len(answered)) if answered else None,
            "rejected": len(rejected) / len(rows) if rows else None,
            "used": statistics.fmean(t / budget for t in ttft) if ttft else None,
            "ttft_p50": quantile_or_none(ttft, 0.5), "ttft_p95": quantile_or_none(ttft, 0.95),
            "queue_p95": quantile_or_none(queue, 0.95),
            "k_mean": statistics.fmean(r["k"] for r in answered) if answered else None,
            "other_errors": len(rows) - len(answered) - len(rejected)}


def read_rows(out: Path) -> list[dict[str, Any]]:
    """Every row of a ``--out`` jsonl file (``[]`` when it does not exist yet)."""
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]


def report(out: Path) -> str:
    """The markdown table of every complete cell in ``out``, arms side by side."""
    rows = [r for r in read_rows(out) if r.get("kind") == "answer"]
    cells: dict[tuple[str, float, int], dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        cells.setdefault((r["load"], r["budget"], r["tokens"]), {}).setdefault(r["arm"], []).append(r)

    def f(v: Any, pct: bool = False) -> str:
        if v is None:
            return "-"
        return f"{100 * v:.0f} %" if pct else f"{v:.0f}"

    lines = ["| load | budget ms | new tokens | arm | answered | within budget | rejected fast | "
             "budget used | TTFT p50 | TTFT p95 | queue p95 | mean k |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (load, budget, tokens), arms in cells.items():
        for arm in ARMS:
            if arm not in arms:
                continue
            s = summarise(arms[arm], budget)
            lines.append(f"| {load} | {budget:.0f} | {tokens} | {arm} | {s['answered']}/{s['requests']} | "
                         f"{f(s['within'], True)} | {f(s['rejected'], True)} | {f(s['used'], True)} | "
                         f"{f(s['ttft_p50'])} | {f(s['ttft_p95'])} | {f(s['queue_p95'])} | "
                         f"{'-' if s['k_mean'] is None else format(s['k_mean'], '.1f')} |")
    total = {arm: [r for r in rows if r["arm"] == arm] for arm in ARMS}
    for arm, rs in total.items():
        ans = [r for r in rs if r["status"] == 200]
        if rs:
            lines.append(f"\n{arm}: {len(rs)} requests, {len(ans)} answered, "
                         f"{sum(1 for r in ans if r['within'])} within budget, "
                         f"{sum(1 for r in rs if r['status'] == 503)} rejected fast")
        if ans:
            lines.append(arm_figures(arm, ans))
        refused = refusal_figures(arm, rs)
        if refused:
            lines.append(refused)
    return "\n".join(lines)


def refusal_figures(arm: str, rows: list[dict[str, Any]]) -> str | None:
    """One line of an arm's fast refusals (503 ``budget_unreachable``), None when there were none:
    per cell with any, how many, where they were decided (``arrival``: on arrival, before
    retrieval; ``granted``: when the model was granted), the predicted k = 0 TTFT they were refused
    on against the budget (min-max ms), the client's time spent on them (sum of ``client_ms``),
    and the ``Retry-After`` they were given (min-max s; rows from runs that recorded it)."""
    cells: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
    for r in rows:
        if r["status"] == 503:
            cells.setdefault((r["load"], r["budget"], r["tokens"]), []).append(r)
    if not cells:
        return None

    def span(v: list[float], spec: str) -> str:
        return "-" if not v else f"{min(v):{spec}}-{max(v):{spec}}"

    parts = []
    for (load, budget, tokens), rs in cells.items():
        where = Counter(r.get("where") or "?" for r in rs)
        predicted = [float(r["predicted_ttft_ms"]) for r in rs if r.get("predicted_ttft_ms") is not None]
        retry = [float(r["retry_after_s"]) for r in rs if r.get("retry_after_s") is not None]
        client = sum(float(r.get("client_ms") or 0.0) for r in rs)
        parts.append(f"{load} {budget:.0f} ms {tokens} tok: {len(rs)} ({dict(where)}), predicted "
                     f"{span(predicted, '.0f')} ms, {client / 1000.0:.2f} s of client time, "
                     f"Retry-After {span(retry, '.0f')} s")
    return f"{arm} refusals: " + "; ".join(parts)


def arm_figures(arm: str, answered: list[dict[str, Any]]) -> str:
    """One line of an arm's answered requests: cells with every answer within budget, cells
    with >= 95 % of answers within budget (the issue's per-cell goal), how many of those short
    have no more misses than exactly 95 % coverage gives at least 5 % of the time, and how many
    cells exactly 95 % coverage would leave short (:func:`short_cell_odds`), mean budget used and
    cells using >= 70 % of it, misses by cause, the median of measured TTFT / planned p95
    for answers alone (closed-1) and beside others (every other load), and mean budget used per
    budget."""
    cells: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
    for r in answered:
        cells.setdefault((r["load"], r["budget"], r["tokens"]), []).append(r)
    full = sum(1 for rs in cells.values() if all(r["within"] for r in rs))
    goal = sum(1 for rs in cells.values() if sum(1 for r in rs if r["within"]) >= 0.95 * len(rs))
    # A short cell whose misses a planner with exactly 95 % coverage would leave at least 5 % of
    # the time (one-sided exact binomial test at the 5 % level) is not evidence against p95.
    chance = sum(1 for rs in cells.values()
                 if sum(1 for r in rs if r["within"]) < 0.95 * len(rs)
                 and binomial_tail(len(rs), sum(1 for r in rs if not r["within"]), 0.05) >= 0.05)
    expected_short = short_cell_odds([len(rs) for rs in cells.values()])
    used = [r["ttft_ms"] / r["budget"] for r in answered]
    wide = sum(1 for rs in cells.values() if statistics.mean(r["ttft_ms"] / r["budget"] for r in rs) >= 0.7)
    causes = Counter(r.get("cause") or "?" for r in answered if not r["within"])

    def ratio(rs: list[dict[str, Any]]) -> str:
        v = [r["ttft_ms"] / r["predicted_p95_ms"] for r in rs if r.get("predicted_p95_ms")]
        return f"{statistics.median(v):.2f}" if v else "-"

    alone = [r for r in answered if r["load"] == "closed-1"]
    others = [r for r in answered if r["load"] != "closed-1"]
    line = (f"{arm}: cells all within budget {full} of {len(cells)}, >= 95 % within {goal} of "
            f"{len(cells)} (of those short, {chance} within a 95 % coverage's chance misses; "
            f"expected short at exactly 95 %: {expected_short:.1f}); mean budget used "
            f"{100 * statistics.mean(used):.1f} %, cells >= 70 % {wide} of {len(cells)}; misses "
            f"{dict(causes) or 'none'}; measured TTFT / planned p95 median {ratio(alone)} alone, "
            f"{ratio(others)} beside others; k bound by {dict(Counter(r['binding'] for r in answered))}")
    # The conformal multiplier in force, by the group of answers that set it (rows from runs
    # that recorded it; "pooled": the window of every answer, before a group had its own band).
    mults: dict[str, list[float]] = {}
    for r in answered:
        if r.get("p95_multiplier") is not None:
            mults.setdefault(r.get("correction_group") or "pooled", []).append(r["p95_multiplier"])
    by_budget: dict[float, list[float]] = {}
    for x in answered:
        by_budget.setdefault(float(x["budget"]), []).append(x["ttft_ms"] / x["budget"])
    line += "; mean budget used by budget " + ", ".join(
        f"{b:.0f} ms {100 * statistics.mean(v):.1f} %" for b, v in sorted(by_budget.items()))
    if mults:
        line += "; p95 multiplier median " + ", ".join(
            f"{g} {statistics.median(v):.2f} (n={len(v)})" for g, v in sorted(mults.items()))
    return line


def engine_sweep_report(cells: list[dict[str, Any]]) -> str:
    """Markdown table of ``--engine-sweep`` cells pooled over rounds, per clients and setting."""
    groups: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["clients"], c["max_running"], c["step_token_budget"]), []).append(c)
    lines = ["| clients | max running | step token budget | within budget | goodput /min | TTFT p50 | "
             "TTFT p95 | TPOT ms | mean k |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (clients, running, budget), cs in sorted(groups.items()):
        rows = [r for c in cs for r in c["rows"] if r["status"] == 200]
        ttft = [r["ttft_ms"] for r in rows if r.get("ttft_ms") is not None]
        tpot = [r["tpot_ms"] for r in rows if r.get("tpot_ms") is not None]
        within = sum(1 for r in rows if r["within"])
        wall = sum(c["wall_s"] for c in cs)
        lines.append(f"| {clients} | {running} | {budget} | {within}/{sum(c['requests'] for c in cs)} | "
                     f"{60.0 * within / wall:.1f} | {quantile_or_none(ttft, 0.5) or 0:.0f} | "
                     f"{quantile_or_none(ttft, 0.95) or 0:.0f} | "
                     f"{statistics.fmean(tpot) if tpot else 0:.1f} | "
                     f"{statistics.fmean(r['k'] for r in rows) if rows else 0:.1f} |")
    return "\n".join(lines)


def batching_report(cells: list[dict[str, Any]]) -> str:
    """Markdown table of ``--batching`` cells with the ratios of the goals (4 clients batched:
    goodput vs serial, TTFT p95 and TPOT vs 1 client batched), and, for keyed runs, the median and
    max of the answers' key check time (``auth_ms`` of the cells' rows)."""

    def f(v: Any, spec: str = ".0f") -> str:
        return "-" if v is None else format(v, spec)

    lines = ["| clients | arm | within budget | wall s | goodput /min | answers /min | TTFT p50 | "
             "TTFT p95 | TPOT ms | mean k |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(c["clients"], c["arm"]): c for c in cells}
    for c in cells:
        lines.append(f"| {c['clients']} | {c['arm']} | {c['within']}/{c['requests']} | {c['wall_s']:.0f} | "
                     f"{c['goodput_per_min']:.1f} | {c['answers_per_min']:.1f} | {f(c['ttft_p50'])} | "
                     f"{f(c['ttft_p95'])} | {f(c['tpot_mean'], '.1f')} | {f(c['k_mean'], '.1f')} |")
    b4, s4, b1 = by.get((4, "batched")), by.get((4, "serial")), by.get((1, "batched"))
    if b4 and s4 and s4["goodput_per_min"]:
        ratio = b4["goodput_per_min"] / s4["goodput_per_min"]
        lines.append(f"\n4 clients: goodput batched / serial = {ratio:.2f}x")
    if b4 and b1 and b1["ttft_p95"] and b4["ttft_p95"] is not None:
        lines.append(f"4 clients batched vs 1 client: TTFT p95 {b4['ttft_p95'] / b1['ttft_p95']:.2f}x")
    if b4 and b1 and b1["tpot_mean"] and b4["tpot_mean"] is not None:
        lines.append(f"4 clients batched vs 1 client: TPOT {b4['tpot_mean'] / b1['tpot_mean']:.2f}x")
    auth = [float(x["auth_ms"]) for c in cells for x in c.get("rows") or []
            if isinstance(x, dict) and x.get("auth_ms") is not None]
    if auth:
        lines.append(f"key check (auth_ms) over {len(auth)} keyed answers: median "
                     f"{statistics.median(auth):.2f} ms, max {max(auth):.2f} ms")
    return "\n".join(lines)
