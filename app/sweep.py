"""The chunk-count vs TTFT tuning report (``ragbudget sweep``).

For each question and each k from 0 to k_max, the prompt with the first k
ranked chunks is prefilled on the real generator (scaffold served from the
prefix cache, as in serving) and the time to the first token is measured
(median of ``repeats``, k visited in a seeded random order so drift does not
masquerade as a trend). Measured TTFT = the question's measured pipeline
overhead (retrieval + planning + assembly) + that prefill median, the same
quantity the planner predicts as ``overhead + p50/p95``. With labels, recall@k
says whether a relevant page is among the first k chunks, so the report answers
"is one more chunk worth its wait?".
"""

from __future__ import annotations

import csv
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from foundation.errors import InvalidInput


@dataclass
class SweepRow:
    """One (question, k) measurement; times in ms."""

    question_id: str
    k: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    overhead_ms: float
    prefill_ms_median: float
    measured_ttft_ms: float
    predicted_p50_ms: float
    predicted_p95_ms: float
    relevant_in_top_k: bool | None


#: The project's operational questions (JSON, ``[{"id", "question"}]``).
OPERATIONAL = Path(__file__).resolve().parent / "questions" / "operational.json"


def default_questions(data_dir: Path, n_index: int, seed: int) -> list[dict[str, Any]]:
    """The project's operational questions plus ``n_index`` drawn (with ``seed``) from the book index
    of the newest PostgreSQL docs fetched under ``<data_dir>/corpora`` (derived at run time, never
    stored); just the operational ones when no corpus was fetched."""
    questions = load_questions(OPERATIONAL)
    corpora = sorted((data_dir / "corpora").glob("postgres-docs-*"))
    if corpora and n_index > 0:
        questions += bookindex_questions(corpora[-1], n_index, seed)
    return questions


def load_questions(path: Path) -> list[dict[str, Any]]:
    """Questions from JSON (``[{"id", "question", "relevant": [...]?}]`` or ``["q", ...]``) or text
    (one per line). Raises InvalidInput when the file is empty or malformed."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [line.strip() for line in text.splitlines() if line.strip()]
    out: list[dict[str, Any]] = []
    for i, q in enumerate(data if isinstance(data, list) else []):
        if isinstance(q, str):
            out.append({"id": f"q{i + 1}", "question": q})
        elif isinstance(q, dict) and str(q.get("question", "")).strip():
            out.append({"id": str(q.get("id") or f"q{i + 1}"), "question": q["question"],
                        **({"relevant": list(q["relevant"])} if q.get("relevant") else {})})
    if not out:
        raise InvalidInput(f"{path}: no questions found", code="no_questions")
    return out


def load_labels(path: Path) -> dict[str, set[str]]:
    """Labels JSON: ``{question id or question text: [relevant document ids]}``.

    Raises:
        InvalidInput (``invalid_labels``): unreadable, not JSON, not an object of lists.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInput(f"{path}: cannot read labels: {exc}", code="invalid_labels") from exc
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise InvalidInput(f"{path}: labels must be a JSON object of lists of document ids",
                           code="invalid_labels")
    return {str(k): set(map(str, v)) for k, v in data.items()}


def apply_labels(questions: list[dict[str, Any]], labels: dict[str, set[str]]) -> list[str]:
    """Set each question's ``relevant`` pages from ``labels`` (matched by id, then by text).

    Returns the label keys that matched no question (for a warning).

    Raises:
        InvalidInput (``invalid_labels``): no label key matches any question, so recall@k
            could not be computed at all (usually ids that differ from the questions file).
    """
    used: set[str] = set()
    for q in questions:
        for key in (q.get("id"), q.get("question")):
            if key is not None and key in labels:
                q["relevant"] = sorted(labels[key])
                used.add(key)
                break
    if labels and not used:
        raise InvalidInput("no label matches a question id or text; recall@k would be empty",
                           code="invalid_labels")
    return sorted(set(labels) - used)


def bookindex_questions(corpus_dir: Path, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` questions sampled (seeded) from the corpus's own back-of-book index, with labels.

    Index terms with one to three linked pages are used (specific enough to grade).
    Raises InvalidInput when the corpus has no ``bookindex.html``.
    """
    from retrieval.bookindex import parse_bookindex

    page = corpus_dir / "bookindex.html"
    if not page.is_file():
        raise InvalidInput(f"{page} not found; run `ragbudget corpus fetch postgres-docs`",
                           code="no_bookindex")
    entries = [(q, p) for q, p in parse_bookindex(page.read_text(encoding="utf-8", errors="replace"))
               if 1 <= len(p) <= 3 and len(q) >= 8]
    rng = random.Random(seed)
    picked = rng.sample(entries, min(n, len(entries)))
    return [{"id": f"index-{i + 1}", "question": q, "relevant": sorted(p)}
            for i, (q, p) in enumerate(picked)]


def run_sweep(pipeline: Any, questions: list[dict[str, Any]], *, k_max: int, budgets: list[float],
              repeats: int = 2, seed: int = 0,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure TTFT for k = 0..k_max per question; returns ``{"rows", "choices", "summary"}``.

    ``pipeline`` is an :class:`app.answering.pipeline.AnswerPipeline` (warmed). ``choices``
    holds, per question and budget, the k the planner picks.
    """
    from app.answering.state import AnswerRequest
    from app.prompting.slots import in_first_slots
    from generation.base import GenParams
    from latency_model.planner import plan as make_plan

    gen = pipeline.services.generator
    rng = random.Random(seed)
    rows: list[SweepRow] = []
    choices: list[dict[str, Any]] = []
    for qi, q in enumerate(questions):
        prepared = pipeline.prepare(AnswerRequest(question=q["question"], ttft_budget_ms=max(budgets),
                                                  k_max=k_max, max_new_tokens=1))
        hits = prepared.retrieval.hits
        scaffold, builder = pipeline.scaffold_and_builder()
        overhead = prepared.plan.overhead_ms
        relevant = set(q.get("relevant") or [])
        # k counts prompt slots (app.prompting.slots): identical chunk texts among the hits share one
        slots = pipeline.prompt_chunks(hits)
        ks = list(range(0, min(k_max, len(slots)) + 1))
        samples: dict[int, list[float]] = {k: [] for k in ks}
        prompts = {k: builder.build(scaffold.text, slots[:k], q["question"]) for k in ks}
        order = [k for _ in range(repeats) for k in ks]
        rng.shuffle(order)
        for k in order:
            p = prompts[k]
            t0 = time.perf_counter()
            first = None
            for ev in gen.stream(p.ids, cached_prefix_ids=p.scaffold_ids,
                                 params=GenParams(max_new_tokens=1)):
                first = ev.t
            samples[k].append(((first or time.perf_counter()) - t0) * 1000.0)
        for k in ks:
            r = prepared.plan.rows[k]
            med = statistics.median(samples[k])
            rows.append(SweepRow(
                question_id=q["id"], k=k, prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                computed_tokens=r.computed_tokens, overhead_ms=overhead, prefill_ms_median=med,
                measured_ttft_ms=overhead + med, predicted_p50_ms=overhead + r.ttft_p50_ms,
                predicted_p95_ms=overhead + r.ttft_p95_ms,
                relevant_in_top_k=(any(h.document_id in relevant for h in in_first_slots(hits, k))
                                   if relevant else None)))
        full = prepared.full_prompt
        for b in budgets:
            chosen = make_plan(
                question_tokens=full.question_tokens, scaffold_tokens=full.scaffold_len,
                scaffold_cached=prepared.scaffold_cached, chunk_tokens=list(full.chunk_token_counts),
                budget_ms=b, profile=prepared.profile, max_new_tokens=prepared.max_new_tokens,
                context_window=gen.context_window, overhead_ms=overhead,
                extra_tokens=full.framing_tokens).chosen_k
            choices.append({"question_id": q["id"], "budget_ms": b,
                            "chosen_k": None if chosen is None else min(chosen, ks[-1])})
        if progress:
            progress(f"[{qi + 1}/{len(questions)}] {q['question'][:60]}: k 0..{ks[-1]}, "
                     f"TTFT {rows[-len(ks)].measured_ttft_ms:.0f}..{rows[-1].measured_ttft_ms:.0f} ms")
    return {"rows": rows, "choices": choices, "summary": summarise(rows, choices, budgets)}


def summarise(rows: list[SweepRow], choices: list[dict[str, Any]], budgets: list[float]) -> dict[str, Any]:
    """Per-k medians over questions, recall@k, and per-budget chosen k with measured adherence."""
    by_k: dict[int, list[SweepRow]] = {}
    for r in rows:
        by_k.setdefault(r.k, []).append(r)
    per_k = []
    for k in sorted(by_k):
        rs = by_k[k]
        labelled = [r.relevant_in_top_k for r in rs if r.relevant_in_top_k is not None]
        per_k.append({
            "k": k, "questions": len(rs),
            "measured_ttft_ms_median": statistics.median(r.measured_ttft_ms for r in rs),
            "predicted_p50_ms_median": statistics.median(r.predicted_p50_ms for r in rs),
            "predicted_p95_ms_median": statistics.median(r.predicted_p95_ms for r in rs),
            "prompt_tokens_median": statistics.median(r.prompt_tokens for r in rs),
            "recall_at_k": (sum(labelled) / len(labelled)) if labelled else None,
        })
    measured = {(r.question_id, r.k): r.measured_ttft_ms for r in rows}
    per_budget = []
    for b in budgets:
        cs = [c for c in choices if c["budget_ms"] == b and c["chosen_k"] is not None]
        ttfts = [measured[(c["question_id"], c["chosen_k"])] for c in cs]
        per_budget.append({
            "budget_ms": b, "answers": len(cs),
            "chosen_k_median": statistics.median(c["chosen_k"] for c in cs) if cs else None,
            "within_budget": (sum(t <= b for t in ttfts) / len(ttfts)) if ttfts else None,
            "budget_used_mean": (statistics.fmean(t / b for t in ttfts)) if ttfts else None,
        })
    return {"per_k": per_k, "per_budget": per_budget}


def write_outputs(out_dir: Path, result: dict[str, Any], meta: dict[str, Any]) -> dict[str, str]:
    """Write ``sweep.csv``, ``sweep.json`` and ``sweep.png`` into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path, png_path = out_dir / "sweep.csv", out_dir / "sweep.json", out_dir / "sweep.png"
    rows: list[SweepRow] = result["rows"]
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(SweepRow.__dataclass_fields__))
        w.writeheader()
        for r in rows:
            d = asdict(r)
            w.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in d.items()})
    json_path.write_text(json.dumps({"meta": meta, "summary": result["summary"],
                                     "choices": result["choices"]}, indent=2, sort_keys=True))
    plot(result["summary"], meta, png_path)
    return {"csv": str(csv_path), "json": str(json_path), "png": str(png_path)}


LAST_SWEEP = Path("sweeps") / "last.json"


def record_last(data_dir: Path, result: dict[str, Any], meta: dict[str, Any],
                outputs: dict[str, str]) -> Path:
    """Keep the newest sweep's summary at ``<data_dir>/sweeps/last.json`` (replaced atomically).

    The console overlays its measured per-k medians on the tuning curve. Written:
    ``{"created_at", "meta" (without the question texts; ``n_questions`` instead),
    "summary", "outputs"}``.
    """
    from foundation.provenance import utc_now_iso

    path = data_dir / LAST_SWEEP
    path.parent.mkdir(parents=True, exist_ok=True)
    slim = {k: v for k, v in meta.items() if k != "questions"}
    slim["n_questions"] = len(meta.get("questions") or [])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"created_at": utc_now_iso(), "meta": slim, "summary": result["summary"],
                               "outputs": outputs}, indent=2, sort_keys=True), encoding="utf-8")
    tmp.replace(path)
    return path


def load_last(data_dir: Path) -> dict[str, Any] | None:
    """The record :func:`record_last` wrote, or None when no sweep ran (or it is unreadable)."""
    path = data_dir / LAST_SWEEP
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("summary"), dict) else None


def plot(summary: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    """Measured and predicted TTFT against k (p50 line, p50-p95 band), budget lines with the k
    each budget chooses, and recall@k on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_k = summary["per_k"]
    ks = [r["k"] for r in per_k]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ax.plot(ks, [r["measured_ttft_ms_median"] for r in per_k], "o-", color="black",
            label="measured TTFT (median over questions)")
    ax.plot(ks, [r["predicted_p50_ms_median"] for r in per_k], "--", color="tab:blue",
            label=f"predicted p50 ({meta.get('profile_source', '?')} profile)")
    ax.fill_between(ks, [r["predicted_p50_ms_median"] for r in per_k],
                    [r["predicted_p95_ms_median"] for r in per_k], color="tab:blue", alpha=0.2,
                    label="predicted p50-p95")
    colors = ["tab:red", "tab:orange", "tab:green", "tab:purple", "tab:brown"]
    for i, b in enumerate(summary["per_budget"]):
        c = colors[i % len(colors)]
        ax.axhline(b["budget_ms"], color=c, lw=1, ls=":")
        if b["chosen_k_median"] is not None:
            ax.axvline(b["chosen_k_median"], color=c, lw=1, alpha=0.6)
            ax.annotate(f"{b['budget_ms']:.0f} ms -> k={b['chosen_k_median']:g}",
                        (b["chosen_k_median"], b["budget_ms"]), textcoords="offset points",
                        xytext=(4, 4), color=c, fontsize=8)
    ax.set_xlabel("k (chunks in the prompt, rank order)")
    ax.set_ylabel("TTFT (ms), retrieval overhead included")
    ax.set_title(f"Chunk count vs TTFT: {meta.get('model', '')}\n{meta.get('device', '')}, "
                 f"{meta.get('dtype', '')}, {meta.get('threads', '')} threads, "
                 f"median of {meta.get('repeats', '')} prefills per (question, k)", fontsize=10)
    recall = [r["recall_at_k"] for r in per_k]
    if any(v is not None for v in recall):
        ax2 = ax.twinx()
        ax2.plot(ks, [v if v is not None else float("nan") for v in recall], "s-", color="tab:green",
                 alpha=0.7, label="recall@k (relevant page in first k)")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("recall@k")
        ax2.legend(loc="lower right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
