"""What the started-answer journal costs: the row written when an answer gets the model, and
the receipt append that deletes it, against an append with no row; SQLite and PostgreSQL.

Per backend (a fresh SQLite file; a fresh schema in the local PostgreSQL ``test`` database when
it is reachable), ``--rows`` answers, each: ``open_entry`` (timed: the journal write), then
``append_receipt`` with that id (timed: append + row delete), then an ``append_receipt`` of
the same body without a row (timed: the plain append). Bodies from ``ragbudget_testing.synthetic_receipts``
(status ``interrupted``, no output, for the row; ``ok`` for the receipts). Prints p50/p95 ms
per step with the CPU model and load average.

    python -m benchmarks.journal --rows 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from app.db import upgrade
from benchmarks.common import elapsed_ms, machine_line
from foundation.db import make_engine
from ragbudget_testing import synthetic_receipts as synthetic
from receipts.chain import append_receipt, new_receipt_id
from receipts.journal import open_entry

PG_BASE = os.environ.get("RAGBUDGET_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _ms(t0: float) -> float:
    return elapsed_ms(t0)


def measure(url: str, rows: int) -> dict[str, Any]:
    """``{step: (p50, p95)}`` in ms for ``rows`` answers on the database at ``url``."""
    engine = make_engine(url)
    upgrade(engine)
    started = synthetic.body(status="interrupted")
    started["output"] = None
    times: dict[str, list[float]] = {"journal_write": [], "append_with_row": [], "append_plain": []}
    for _ in range(rows):
        rid = new_receipt_id()
        t0 = time.perf_counter()
        open_entry(engine, rid, dict(started))
        times["journal_write"].append(_ms(t0))
        t0 = time.perf_counter()
        append_receipt(engine, synthetic.body(), receipt_id=rid)
        times["append_with_row"].append(_ms(t0))
        t0 = time.perf_counter()
        append_receipt(engine, synthetic.body())
        times["append_plain"].append(_ms(t0))
    engine.dispose()
    return {k: (statistics.median(v), sorted(v)[int(0.95 * (len(v) - 1))]) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    """Run both backends (PostgreSQL only when reachable) and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--rows", type=int, default=200)
    args = ap.parse_args(argv)
    print(f"machine: {machine_line()}")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["sqlite"] = measure(f"sqlite:///{Path(tmp) / 'journal.db'}", args.rows)
    schema = "journal_bench_" + uuid.uuid4().hex[:8]
    admin = create_engine(PG_BASE, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f'CREATE SCHEMA "{schema}"'))
    except Exception as exc:  # no PostgreSQL here: SQLite only
        print(f"PostgreSQL not measured: {exc.__class__.__name__}")
    else:
        try:
            results["postgresql"] = measure(f"{PG_BASE}?options=-csearch_path%3D{schema}", args.rows)
        finally:
            with admin.connect() as c:
                c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()
    for backend, steps in results.items():
        for step, (p50, p95) in steps.items():
            print(f"{backend:10s} {step:16s} p50 {p50:6.2f} ms  p95 {p95:6.2f} ms")
    print(f"load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
