"""``ragbudget ask`` (stream an answer) and ``ragbudget advise`` (plan only)."""

from __future__ import annotations

import argparse
import sys
import threading
from typing import TYPE_CHECKING

from app.cli.common import add_json_flag, emit

if TYPE_CHECKING:
    from app.answering.types import Advice, Answer


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``ask`` and ``advise`` to the top-level subparsers ``sub`` (``app.cli.main``)."""
    a = sub.add_parser("ask", help="answer a question within a TTFT budget, streamed")
    a.add_argument("question")
    a.add_argument("--budget-ms", type=float, default=None,
                   help="TTFT budget in ms (default: RAGBUDGET_DEFAULT_TTFT_BUDGET_MS)")
    a.add_argument("--max-new-tokens", type=int, default=None)
    a.add_argument("--revision", type=int, default=None)
    a.add_argument("--k-max", type=int, default=None)
    a.add_argument("--on-budget-miss", choices=("answer", "reject"), default=None,
                   help="when even k=0 cannot make the budget: answer anyway (default: "
                        "RAGBUDGET_ON_BUDGET_MISS) or refuse (exit non-zero, no receipt)")
    add_json_flag(a)
    a.set_defaults(func=cmd_ask)
    d = sub.add_parser("advise", help="how many chunks fit the TTFT budget (no generation)")
    d.add_argument("question")
    d.add_argument("--budget-ms", type=float, default=None,
                   help="TTFT budget in ms (default: RAGBUDGET_DEFAULT_TTFT_BUDGET_MS)")
    d.add_argument("--revision", type=int, default=None)
    d.add_argument("--k-max", type=int, default=None)
    d.add_argument("--max-new-tokens", type=int, default=None)
    add_json_flag(d)
    d.set_defaults(func=cmd_advise)


def _fmt(v: float | None, unit: str = " ms") -> str:
    return "-" if v is None else f"{v:.0f}{unit}"


def render_summary(s: Answer) -> str:
    """The few lines printed under a streamed answer."""
    p, t, tok = s.predicted, s.timings, s.tokens
    cites = ", ".join(f"[{i + 1}] {c.document_id} v{c.version}" for i, c in enumerate(s.citations))
    miss = ""
    if s.within_budget is False and t.ttft_ms is not None:
        miss = (f" | OVER BUDGET by {t.ttft_ms - s.ttft_budget_ms:.0f} ms"
                f" ({s.budget_miss_cause or 'cause unknown'})")
    return "\n".join([
        f"status {s.status} | k={s.chosen_k} ({s.binding}) | budget {_fmt(s.ttft_budget_ms)}",
        f"TTFT predicted p50 {_fmt(p.ttft_p50_ms)} / p95 {_fmt(p.ttft_p95_ms)} "
        f"[{p.profile_source} profile] | measured {_fmt(t.ttft_ms)} "
        f"(queue {_fmt(t.queue_ms)}, retrieval {_fmt(t.retrieval_ms)}, prefill {_fmt(t.prefill_ms)})"
        f" | TPOT {_fmt(t.tpot_ms)}"
        f"{miss}",
        f"tokens: prompt {tok.prompt} (cached {tok.cached}, computed {tok.computed}), "
        f"output {tok.output}",
        f"sources: {cites or '(none)'}",
        f"receipt: {s.receipt_id}" + ("" if s.receipt_status == "written"
                                      else f" ({s.receipt_status}: {s.receipt_error})"),
    ])


def cmd_ask(args: argparse.Namespace, services) -> int:  # type: ignore[no-untyped-def]
    """``ragbudget ask``: stream the answer's tokens to stdout, then its summary (or, with
    ``--json``, only the summary as JSON).

    Returns 0 when the answer's status is ``ok``, else 1. Bad input (blank question, bad
    budget, k or revision) raises the pipeline's ``InvalidInput`` before any token, which
    ``app.cli.main`` turns into a one-line message and exit code 2.
    """
    from app.answering.pipeline import AnswerPipeline
    from app.answering.state import AnswerRequest

    pipeline = AnswerPipeline(services)
    pipeline.warm()  # model loading stays outside the clock; the answer's clock starts at stream()
    req = AnswerRequest(question=args.question, ttft_budget_ms=args.budget_ms,
                        max_new_tokens=args.max_new_tokens, revision=args.revision, k_max=args.k_max,
                        on_budget_miss=args.on_budget_miss)
    cancel = threading.Event()
    summary: Answer | None = None
    try:
        for ev in pipeline.stream(req, cancel=cancel):
            if ev.kind == "token" and not args.json:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            elif ev.summary is not None:
                summary = ev.summary
    except KeyboardInterrupt:
        cancel.set()
        raise
    if not args.json:
        print("\n")
    assert summary is not None, "the pipeline ends every stream with a summary"
    emit(args, summary, render_summary)
    return 0 if summary.status == "ok" else 1


def cmd_advise(args: argparse.Namespace, services) -> int:  # type: ignore[no-untyped-def]
    """``ragbudget advise``: retrieve and plan without generating; print the per-k table
    (prompt, cached and computed tokens; predicted prefill and TTFT p50/p95 in ms, overhead
    included) and the chosen k. Returns 0; bad input raises ``InvalidInput`` (exit 2).
    """
    from app.answering.pipeline import AnswerPipeline
    from app.answering.state import AnswerRequest

    pipeline = AnswerPipeline(services)
    pipeline.warm()
    out = pipeline.advise(AnswerRequest(
        question=args.question, ttft_budget_ms=args.budget_ms, revision=args.revision,
        k_max=args.k_max, max_new_tokens=args.max_new_tokens))

    def human(o: Advice) -> str:
        plan = o.plan
        over = plan.overhead_ms
        lines = [f"budget {o.ttft_budget_ms:.0f} ms, revision {o.revision}, profile "
                 f"{o.profile.id[:19]} ({o.profile.source})",
                 f"TTFT = overhead {over:.0f} ms (retrieval, tokenisation, measured) + prefill; "
                 f"a row fits when its TTFT p95 <= the budget",
                 f"{'k':>3} {'prompt':>7} {'cached':>7} {'computed':>8} {'prefill p50':>11} "
                 f"{'TTFT p50':>9} {'TTFT p95':>9}  fits"]
        for r in plan.rows:
            mark = " <- chosen" if r.k == plan.chosen_k else ""
            fits = "yes" if r.fits_budget and r.fits_context else "no"
            lines.append(f"{r.k:>3} {r.prompt_tokens:>7} {r.cached_tokens:>7} "
                         f"{r.computed_tokens:>8} {r.ttft_p50_ms:>11.0f} "
                         f"{r.ttft_p50_ms + over:>9.0f} {r.ttft_p95_ms + over:>9.0f}  "
                         f"{fits}{mark}")
        lines.append(f"chosen k = {plan.chosen_k} (binding: {plan.binding}): {plan.message}")
        return "\n".join(lines)

    emit(args, out, human)
    return 0
