"""``ragbudget demo``: the main job, end to end on the real corpus.

1. fetch and ingest the PostgreSQL 15.18 documentation (with embeddings);
2. calibrate the latency model on this device (``--quick``; reused if a fitted
   profile for this device and model exists);
3. answer a few operational questions within a TTFT budget, printing each
   answer with its chosen k, predicted vs measured TTFT, TPOT and receipt id;
4. fetch and ingest 15.20;
5. replay an earlier receipt (regenerating its answer) and print the report
   with its freshness section.

Progress is kept in ``<data_dir>/demo-state.json``, so a re-run skips what is
done. Every step calls the same services as the commands a user would type
(``app.ingest``, the calibration, ``app.answering.receipt_wiring``) and prints what they
print, in one process, so models are loaded once.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from app.cli.common import add_json_flag

QUESTIONS = [
    "How do I set up continuous archiving of WAL files with archive_command?",
    "What does autovacuum_vacuum_scale_factor control, and when does autovacuum vacuum a table?",
    "How do I dump a single database with pg_dump in the custom archive format?",
]
FIRST, SECOND = "15.18", "15.20"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``ragbudget demo`` to the CLI."""
    d = sub.add_parser("demo", help="the main job end to end on the PostgreSQL docs")
    d.add_argument("--budget-ms", type=float, default=1200.0, help="TTFT budget per answer (ms)")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--restart", action="store_true", help="forget demo progress (keeps the data)")
    add_json_flag(d)
    d.set_defaults(func=cmd_demo)


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


class DemoState:
    """What the demo has done, persisted as JSON next to the data."""

    def __init__(self, path: Path, restart: bool) -> None:
        self.path = path
        self.data: dict[str, Any] = {}
        if path.is_file() and not restart:
            self.data = json.loads(path.read_text())

    def get(self, key: str) -> Any:
        """The value recorded under ``key`` (None when that step has not run)."""
        return self.data.get(key)

    def set(self, key: str, value: Any) -> None:
        """Record ``value`` under ``key`` and write the file atomically (temporary file, rename)."""
        self.data[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, sort_keys=True))
        tmp.replace(self.path)


def _ingest(services: Any, state: DemoState, version: str) -> None:
    from app.cli.corpus_cmds import render_ingest_report
    from app.ingest import IngestService
    from foundation.db import read_session
    from retrieval.store import latest_revision

    key = f"ingested_{version}"
    if state.get(key):
        print(f"PostgreSQL {version} docs already ingested at revision {state.get(key)}; skipping")
        return
    service = IngestService(services)
    fetched = service.fetch_postgres_docs(version)
    print(f"{fetched.pages} pages of PostgreSQL {version} docs in {fetched.path}", flush=True)
    t0 = time.perf_counter()
    outcome = service.ingest_paths([Path(fetched.path)], delete_missing=True,
                                   note=f"postgresql-doc-15 {version}", progress=True)
    print(render_ingest_report(outcome.to_dict()), flush=True)
    if outcome.report.counts["rejected"]:
        raise SystemExit(f"ingest of {version} rejected {outcome.report.counts['rejected']} pages")
    with read_session(services.engine) as s:
        rev = latest_revision(s)
    print(f"ingest wall time {time.perf_counter() - t0:.1f} s", flush=True)
    state.set(key, rev)


def _calibrate(services: Any, state: DemoState) -> None:
    from app.cli.latency_cmds import calibrate_profile, describe
    from app.profile_store import find_profile, key_of

    key = key_of(dict(services.generator.identity))
    found = find_profile(services.engine, key, "fitted")
    if found is not None:
        print(f"fitted latency profile {found.id} exists for this device and model; reusing it")
        return
    summary = calibrate_profile(services, quick=True)
    print(describe(summary) + f"\n  saved    {summary['saved_to']}", flush=True)


def _ask(services: Any, state: DemoState, budget_ms: float, max_new: int) -> list[str]:
    from app.answering.pipeline import AnswerPipeline
    from app.answering.state import AnswerRequest
    from app.answering.types import Answer
    from app.cli.answer_cmds import render_summary

    done = state.get("receipts") or []
    if done:
        print("questions already answered; their receipts: " + ", ".join(done))
        return list(done)
    pipeline = AnswerPipeline(services)
    pipeline.warm()
    receipts = []
    for q in QUESTIONS:
        print(f"\nQ: {q}\nA: ", end="", flush=True)
        summary: Answer | None = None
        for ev in pipeline.stream(AnswerRequest(question=q, ttft_budget_ms=budget_ms,
                                                max_new_tokens=max_new)):
            if ev.kind == "token":
                print(ev.text, end="", flush=True)
            elif ev.summary is not None:
                summary = ev.summary
        assert summary is not None, "the pipeline ends every stream with a summary"
        print("\n" + render_summary(summary), flush=True)
        if summary.receipt_id:
            receipts.append(summary.receipt_id)
    state.set("receipts", receipts)
    return receipts


def _pick_receipt(services: Any, receipts: list[str]) -> str:
    """The first receipt whose cited pages changed since (to show freshness), else the first."""
    from receipts.chain import get_receipt
    from receipts.freshness import freshness

    for rid in receipts:
        fresh = freshness(services.engine, get_receipt(services.engine, rid))
        if any(d.get("cited") and d.get("status") != "current" for d in fresh.get("documents", [])):
            return rid
    return receipts[0]


def cmd_demo(args: argparse.Namespace, services: Any) -> int:  # type: ignore[no-untyped-def]
    """Run the five steps of the module docstring; exit 0, or the replay's exit code."""
    t0 = time.perf_counter()
    state = DemoState(services.data_dir / "demo-state.json", args.restart)
    _banner(f"1/5 fetch and ingest the PostgreSQL {FIRST} documentation")
    _ingest(services, state, FIRST)
    _banner("2/5 calibrate the latency model on this device")
    _calibrate(services, state)
    _banner(f"3/5 answer operational questions within a {args.budget_ms:.0f} ms TTFT budget")
    receipts = _ask(services, state, args.budget_ms, args.max_new_tokens)
    _banner(f"4/5 fetch and ingest the PostgreSQL {SECOND} documentation")
    _ingest(services, state, SECOND)
    _banner("5/5 replay an earlier receipt against the pinned revision")
    rc = 0
    if receipts:
        from app.answering.receipt_wiring import replay_receipt
        from app.cli.receipt_cmds import EXIT_VERIFY_FAILED

        report = replay_receipt(services, _pick_receipt(services, receipts), regenerate=True)
        print(report.render(), flush=True)
        rc = 0 if report.ok else EXIT_VERIFY_FAILED
    print(f"\nmain job finished in {time.perf_counter() - t0:.0f} s (data in {services.data_dir})")
    return rc
