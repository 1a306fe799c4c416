"""Budget adherence, end to end: do answers meet their TTFT budget while using it?

For every (question, budget) pair, one real answer goes through the whole
pipeline (retrieve -> plan at p95 -> assemble -> generate) and its measured
TTFT (request arrival to the first token with text, queue and retrieval
included) is compared with the budget. Reported: the share of answers with
TTFT <= budget (target >= 95 %) and the mean share of the budget used
(target >= 75 %), overall and per budget, plus the chosen k.

Runs against the configured data directory (ingested corpus + calibrated
profile), e.g. after the main job:

    RAGBUDGET_DATA_DIR=ragbudget-data python -m benchmarks.budget_adherence \
        --budgets 500,800,1200,1800,2500 --index-questions 10 --json benchmarks/results/budget_adherence.json

Answers are written as receipts like any other answer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--budgets", default="500,800,1200,1800,2500")
    ap.add_argument("--index-questions", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    from app.answering.pipeline import AnswerPipeline
    from app.answering.state import AnswerRequest
    from app.services import Services
    from app.settings import get_settings
    from app.sweep import default_questions

    services = Services(get_settings())
    budgets = [float(b) for b in args.budgets.split(",")]
    questions = default_questions(services.data_dir, args.index_questions, args.seed)
    pipeline = AnswerPipeline(services)
    pipeline.warm()
    profile = pipeline.profile()
    results = []
    pairs = [(q, b) for q in questions for b in budgets]
    import random

    random.Random(args.seed).shuffle(pairs)  # interleave budgets so drift hits all alike
    for i, (q, b) in enumerate(pairs):
        s = pipeline.answer(AnswerRequest(question=q["question"], ttft_budget_ms=b,
                                          max_new_tokens=args.max_new_tokens))
        ttft = s.timings.ttft_ms
        results.append({"question_id": q["id"], "budget_ms": b, "chosen_k": s.chosen_k,
                        "binding": s.binding, "ttft_ms": ttft,
                        "predicted_p95_ms": s.predicted.ttft_p95_ms,
                        "within": ttft is not None and ttft <= b,
                        "used": (ttft / b) if ttft is not None else None,
                        "receipt_id": s.receipt_id})
        print(f"[{i + 1}/{len(pairs)}] budget {b:6.0f} ms  k={s.chosen_k:>2}  TTFT "
              f"{ttft or 0:7.1f} ms  p95 pred {s.predicted.ttft_p95_ms or 0:7.1f}  {q['id']}",
              file=sys.stderr, flush=True)

    def agg(rows: list[dict]) -> dict:
        used = [r["used"] for r in rows if r["used"] is not None]
        return {"answers": len(rows), "within_budget": sum(r["within"] for r in rows) / len(rows),
                "budget_used_mean": statistics.fmean(used) if used else None,
                "chosen_k_mean": statistics.fmean(r["chosen_k"] for r in rows),
                "ttft_ms_median": statistics.median(r["ttft_ms"] for r in rows)}

    out = {"profile": {"id": profile.id, "source": profile.source},
           "generator": services.generator.identity.get("model_id"),
           "device": services.generator.identity.get("device_name"),
           "threads": services.generator.identity.get("threads"),
           "overall": agg(results),
           "per_budget": {str(b): agg([r for r in results if r["budget_ms"] == b]) for b in budgets},
           "answers": results}
    o = out["overall"]
    print(f"\n{o['answers']} answers: {100 * o['within_budget']:.1f} % within budget "
          f"(target >= 95 %), mean budget used {100 * o['budget_used_mean']:.1f} % (target >= 75 %)")
    for b, a in out["per_budget"].items():
        print(f"  budget {float(b):6.0f} ms: within {100 * a['within_budget']:5.1f} %, used "
              f"{100 * a['budget_used_mean']:5.1f} %, mean k {a['chosen_k_mean']:.2f}, "
              f"median TTFT {a['ttft_ms_median']:.0f} ms")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
