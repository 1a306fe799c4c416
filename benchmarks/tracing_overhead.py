"""Trace export's cost to answers: TTFT and end-to-end time with tracing off and on, interleaved.

One process, one set of services (the packaged SmolLM2-135M-Instruct fp32 on CPU, the
packaged MiniLM embedder, 5 PostgreSQL 15.18 pages from the shared corpus ingested into a
temporary data directory), two pipelines over them: one with tracing off (``otlp_endpoint``
empty: no tracer, the OpenTelemetry SDK never imported) and one exporting every answer over
OTLP/HTTP to a running Arize Phoenix (``.venv-phoenix``, started here on loopback ports;
``--endpoint URL`` sends to another receiver instead). Answers alternate between the two in
a seeded random order per pair, so the machine's drift hits both arms alike.

Per answer: TTFT (the receipt's, request arrival to the first token with text), end-to-end
time (``AnswerPipeline.answer`` wall, receipt write included) and, with tracing on, the time
:meth:`app.tracing.AnswerTracer.export` took on the request thread (building the spans and
queueing them; the HTTP export runs on the ``BatchSpanProcessor``'s thread).

    python -m benchmarks.tracing_overhead --pairs 30 --json benchmarks/results/tracing_overhead.json

Run it under the CPU lock on a shared machine (``flock /tmp/ragbudget-cpu.lock ...``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, elapsed_ms, machine, quantile
from benchmarks.generation import DEB, extract_pages

QUESTIONS = ["How do I dump a database with pg_dump?", "What does VACUUM FULL do?",
             "When does autovacuum run ANALYZE?", "Which index types does PostgreSQL offer?",
             "How do I restore a dump made with pg_dump -Fc?", "What does ANALYZE collect?"]


def summarise(values: list[float]) -> dict[str, float]:
    """Median, p95 (linear interpolation, :func:`benchmarks.common.quantile`), min and max."""
    return {"median": quantile(values, 0.5), "p95": quantile(values, 0.95), "min": min(values),
            "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--pairs", type=int, default=30, help="answers per arm (one off, one on per pair)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--candidates", type=int, default=3, help="K, all chosen (60 s budget)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--endpoint", default=None, help="an OTLP/HTTP traces URL already listening "
                    "(default: start Phoenix from .venv-phoenix)")
    ap.add_argument("--deb", type=Path, default=DEB)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    from app.answering.pipeline import AnswerPipeline
    from app.answering.state import AnswerRequest
    from app.services import Services
    from app.settings import get_settings
    from app.tracing import answer_tracer
    from generation.assets import ensure_packaged_generator
    from ragbudget_testing.phoenix import PhoenixServer
    from retrieval.chunking import ChunkerConfig
    from retrieval.store import IngestItem, ingest_batch

    tmp = Path(tempfile.mkdtemp(prefix="ragbudget-tracebench-"))
    phoenix = None if args.endpoint else PhoenixServer(tmp / "phoenix").start()
    endpoint = args.endpoint or (phoenix.otlp_endpoint if phoenix else "")
    try:
        settings = get_settings(data_dir=tmp / "data", database_url=None, auth_enabled=False,
                                generator_path=str(ensure_packaged_generator(REPO / "ragbudget-data")),
                                generator_device="cpu", torch_threads=args.threads,
                                retrieval_candidates=args.candidates, otlp_endpoint="")
        services = Services(settings)
        texts = extract_pages(args.deb, tmp)
        ingest_batch(services.engine, [IngestItem(document_id=p, text=t) for p, t in texts.items()],
                     tokenizer=services.tokenizer, embedder=services.embedder,
                     chunker_config=ChunkerConfig(settings.chunk_tokens, settings.chunk_overlap_tokens))
        off = AnswerPipeline(services)
        on = AnswerPipeline(services)
        on.tracer = answer_tracer(settings.model_copy(update={"otlp_endpoint": endpoint}), on.metrics)
        assert off.tracer is None and on.tracer is not None
        export_ms: list[float] = []
        real_export = on.tracer.export

        def timed_export(*a: Any) -> None:
            t0 = time.perf_counter()
            real_export(*a)
            export_ms.append(elapsed_ms(t0))

        on.tracer.export = timed_export  # type: ignore[method-assign]
        off.warm()
        on.warm()
        for pipe in (off, on):  # one answer each outside the record (first-call costs)
            pipe.answer(AnswerRequest(question=QUESTIONS[0], ttft_budget_ms=60_000.0,
                                      max_new_tokens=args.max_new_tokens))
        ident = services.generator.identity
        m0 = machine()
        print(f"# {ident['model_id']} | {m0['cpu']} | {m0['cores']} cores | torch threads {args.threads} "
              f"| load average {m0['loadavg'][0]:.2f} | receiver {endpoint}", file=sys.stderr)
        rng = random.Random(args.seed)
        rows: list[dict[str, Any]] = []
        for i in range(args.pairs):
            q = QUESTIONS[i % len(QUESTIONS)]
            order = ["off", "on"]
            rng.shuffle(order)
            for arm in order:
                pipe = on if arm == "on" else off
                t0 = time.perf_counter()
                a = pipe.answer(AnswerRequest(question=q, ttft_budget_ms=60_000.0,
                                              max_new_tokens=args.max_new_tokens))
                rows.append({"pair": i, "arm": arm, "ttft_ms": a.timings.ttft_ms, "e2e_ms": elapsed_ms(t0),
                             "k": a.chosen_k, "prompt_tokens": a.tokens.prompt,
                             "output_tokens": a.tokens.output, "status": a.status})
            print(f"[{i + 1}/{args.pairs}] " + "  ".join(
                f"{r['arm']}: TTFT {r['ttft_ms']:.1f} ms e2e {r['e2e_ms']:.1f} ms" for r in rows[-2:]),
                file=sys.stderr, flush=True)
        flushed = on.tracer.flush()
        exported = on.metrics.registry.get_sample_value("ragbudget_trace_spans_exported_total") or 0.0
        failed = on.metrics.registry.get_sample_value("ragbudget_trace_export_failures_total") or 0.0
        m1 = machine()
    finally:
        if phoenix is not None:
            phoenix.stop()

    arms = {arm: {key: summarise([r[key] for r in rows if r["arm"] == arm]) for key in ("ttft_ms", "e2e_ms")}
            for arm in ("off", "on")}
    pair_delta = {key: summarise([on_r[key] - off_r[key] for off_r, on_r in _pairs(rows)])
                  for key in ("ttft_ms", "e2e_ms")}
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine_start": m0,
           "machine_end": m1, "generator": ident.get("model_id"), "threads": args.threads,
           "pairs": args.pairs, "max_new_tokens": args.max_new_tokens, "candidates": args.candidates,
           "receiver": "phoenix" if phoenix is not None else endpoint, "arms": arms,
           "on_minus_off_per_pair": pair_delta, "export_call_ms": summarise(export_ms),
           "spans_exported": exported, "spans_failed": failed, "flushed": flushed, "rows": rows}
    print(f"\n{args.pairs} pairs, {ident.get('model_id')}, receiver {out['receiver']}")
    print("| arm | TTFT median ms | TTFT p95 | e2e median ms | e2e p95 |\n|---|---:|---:|---:|---:|")
    for arm in ("off", "on"):
        a = arms[arm]
        print(f"| tracing {arm} | {a['ttft_ms']['median']:.1f} | {a['ttft_ms']['p95']:.1f} | "
              f"{a['e2e_ms']['median']:.1f} | {a['e2e_ms']['p95']:.1f} |")
    d, e = pair_delta, out["export_call_ms"]
    print(f"on - off per pair: TTFT median {d['ttft_ms']['median']:+.2f} ms, e2e median "
          f"{d['e2e_ms']['median']:+.2f} ms; export() on the request thread: median {e['median']:.3f} ms, "
          f"p95 {e['p95']:.3f} ms; spans exported {exported:.0f}, failed {failed:.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, sort_keys=True))
    return 0


def _pairs(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(off row, on row)`` of each pair."""
    by_pair: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_pair.setdefault(r["pair"], {})[r["arm"]] = r
    return [(p["off"], p["on"]) for _, p in sorted(by_pair.items())]


if __name__ == "__main__":
    sys.exit(main())
