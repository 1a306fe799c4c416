"""``ragbudget sweep``: the chunk-count vs TTFT tuning report (CSV, JSON summary, PNG)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from app.cli.common import add_json_flag, emit, seed_arg
from foundation.errors import InvalidInput


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``sweep`` to the top-level subparsers ``sub``."""
    s = sub.add_parser("sweep", help="measure TTFT against k (and recall@k): the tuning report")
    s.add_argument("--questions", type=Path, default=None,
                   help="JSON or text file of questions (default: the project's operational questions "
                        "plus questions drawn from the fetched corpus's book index)")
    s.add_argument("--labels", type=Path, default=None,
                   help="JSON {question id or text: [relevant document ids]}")
    s.add_argument("--k-max", type=int, default=16)
    s.add_argument("--budgets", default="300,600,1000", help="comma-separated TTFT budgets in ms")
    s.add_argument("--repeats", type=int, default=2, help="timed prefills per (question, k)")
    s.add_argument("--index-questions", type=int, default=4,
                   help="book-index questions added to the default set")
    s.add_argument("--seed", type=seed_arg, default=0)
    s.add_argument("--out", type=Path, required=True, help="output directory")
    add_json_flag(s)
    s.set_defaults(func=cmd_sweep)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def _budgets(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise InvalidInput(f"--budgets must be comma-separated numbers: {text!r}",
                           code="invalid_budget") from exc
    if not values or any(not (v > 0) for v in values):
        raise InvalidInput("--budgets must be positive numbers of ms", code="invalid_budget")
    return values


def cmd_sweep(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget sweep --out DIR``: for each question and k in 0..``--k-max``, measure TTFT
    ``--repeats`` times beside the profile's prediction (and recall@k with labels);
    write the CSV, JSON summary and PNG to DIR and print the per-k and per-budget summary.

    Returns 0. Raises ``InvalidInput`` (exit 2), writing nothing, on bad ``--budgets``
    (code ``invalid_budget``), ``--k-max`` outside 0..max_k (``invalid_k``) or ``--repeats``
    < 1 (``invalid_repeats``).
    """
    from app.answering.pipeline import AnswerPipeline
    from app.sweep import (
        apply_labels,
        default_questions,
        load_labels,
        load_questions,
        record_last,
        run_sweep,
        write_outputs,
    )

    budgets = _budgets(args.budgets)
    if not 0 <= args.k_max <= services.settings.max_k:
        raise InvalidInput(f"--k-max must be in [0, {services.settings.max_k}]", code="invalid_k")
    if args.repeats < 1:
        raise InvalidInput("--repeats must be >= 1", code="invalid_repeats")
    questions = (load_questions(args.questions) if args.questions
                 else default_questions(services.data_dir, args.index_questions, args.seed))
    if args.labels:
        unmatched = apply_labels(questions, load_labels(args.labels))
        if unmatched:
            print(f"warning: {len(unmatched)} label(s) match no question id or text: "
                  + ", ".join(repr(u) for u in unmatched[:5]), file=sys.stderr)
    pipeline = AnswerPipeline(services)
    pipeline.warm()
    gen = services.generator
    profile = pipeline.profile()
    result = run_sweep(pipeline, questions, k_max=args.k_max, budgets=budgets, repeats=args.repeats,
                       seed=args.seed, progress=lambda m: print(m, file=sys.stderr, flush=True))
    meta = {"model": gen.identity.get("model_id"), "device": gen.identity.get("device_name")
            or gen.identity.get("device"), "dtype": gen.identity.get("dtype"),
            "threads": gen.identity.get("threads"), "profile_id": profile.id,
            "profile_source": profile.source, "k_max": args.k_max, "repeats": args.repeats,
            "budgets_ms": budgets, "questions": questions}
    paths = write_outputs(args.out, result, meta)
    record_last(services.data_dir, result, meta, paths)
    payload = {"outputs": paths, "summary": result["summary"]}

    def human(p: dict[str, Any]) -> str:
        lines = [f"{'k':>3} {'measured ms':>12} {'pred p50':>9} {'pred p95':>9} {'recall@k':>9}"]
        for r in p["summary"]["per_k"]:
            rec = "-" if r["recall_at_k"] is None else f"{r['recall_at_k']:.2f}"
            lines.append(f"{r['k']:>3} {r['measured_ttft_ms_median']:>12.0f} "
                         f"{r['predicted_p50_ms_median']:>9.0f} "
                         f"{r['predicted_p95_ms_median']:>9.0f} {rec:>9}")
        for b in p["summary"]["per_budget"]:
            lines.append(f"budget {b['budget_ms']:.0f} ms: chosen k (median) {_num(b['chosen_k_median'])}, "
                         f"within budget {_pct(b['within_budget'])}, "
                         f"budget used {_pct(b['budget_used_mean'])}")
        lines.append("wrote " + ", ".join(p["outputs"].values()))
        return "\n".join(lines)

    emit(args, payload, human)
    return 0
