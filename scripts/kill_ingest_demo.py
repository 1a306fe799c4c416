"""kill -9 in the middle of a large ingest, then restart: the store stays at the previous revision.

On the real corpus: ingest the PostgreSQL 15.18 docs (revision 1), start ingesting
15.20 in a separate ``ragbudget ingest`` process, kill it with SIGKILL while its
write transaction is open (documents, versions, chunks and the revision row already
inserted but not committed), check that the database is exactly at revision 1 and
consistent, then run the same ingest again and check it commits as revision 2.

    python scripts/kill_ingest_demo.py [--database-url URL] [--data-dir DIR] [--kill-after-s S]

By default the kill is placed with the store's test-only pause hook
(``RAGBUDGET_TEST_PAUSE_IN_COMMIT_S``); ``--kill-after-s`` kills at a wall-clock
time instead, wherever the ingest happens to be. Exit code 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    from sqlalchemy import func, select

    from app.db import open_database
    from app.ingest import SHARED_CORPORA
    from app.settings import get_settings
    from foundation.db import read_session
    from retrieval.corpus import fetch_postgres_docs
    from retrieval.models import Chunk, Document, DocumentVersion, Revision
    from retrieval.store import PAUSE_ENV, PAUSE_MARKER_ENV, latest_revision, verify_store

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--database-url", default=None, help="default: SQLite in the data dir")
    ap.add_argument("--data-dir", type=Path, default=None, help="default: a fresh temporary directory")
    ap.add_argument("--kill-after-s", type=float, default=None,
                    help="kill at this wall time instead of inside the write transaction")
    args = ap.parse_args()
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="ragbudget-kill-"))
    env = {**os.environ, "RAGBUDGET_DATA_DIR": str(data_dir)}
    if args.database_url:
        env["RAGBUDGET_DATABASE_URL"] = args.database_url
    converted = REPO / "ragbudget-data" / "models" / "smollm2-135m-instruct-fp32"
    if (converted / "config.json").is_file():
        env.setdefault("RAGBUDGET_GENERATOR_PATH", str(converted))
    pages = {v: fetch_postgres_docs(data_dir, v, search_dirs=[SHARED_CORPORA]).path
             for v in ("15.18", "15.20")}
    cli = [sys.executable, "-m", "app.cli.main", "ingest", "--no-embed", "--json"]

    def ingest(version: str) -> dict[str, object]:
        out = subprocess.run(cli + [pages[version]], cwd=REPO, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"ingest {version} failed ({out.returncode}): {out.stderr[-2000:]}")
        return dict(json.loads(out.stdout))

    settings = get_settings(data_dir=data_dir, database_url=args.database_url)
    engine = open_database(settings)

    def snapshot() -> dict[str, int]:
        with read_session(engine) as s:
            counts = {m.__tablename__: int(s.scalar(select(func.count()).select_from(m)) or 0)
                      for m in (Revision, Document, DocumentVersion, Chunk)}
            counts["latest_revision"] = latest_revision(s)
        return counts

    t0 = time.perf_counter()
    first = ingest("15.18")
    print(f"15.18 ingested: revision {first['revision']}, counts {first['counts']} "
          f"({time.perf_counter() - t0:.1f} s)")
    before = snapshot()
    marker = data_dir / "in-transaction.marker"
    marker.unlink(missing_ok=True)
    kill_env = dict(env)
    if args.kill_after_s is None:
        kill_env[PAUSE_ENV] = "600"
        kill_env[PAUSE_MARKER_ENV] = str(marker)
    proc = subprocess.Popen(cli + [pages["15.20"]], cwd=REPO, env=kill_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t1 = time.perf_counter()
    if args.kill_after_s is None:
        while not marker.exists():
            if proc.poll() is not None:
                raise SystemExit("the ingest ended before reaching its write transaction")
            time.sleep(0.05)
        where = "inside the open write transaction"
    else:
        time.sleep(args.kill_after_s)
        where = f"after {args.kill_after_s:.1f} s"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"killed ingest of 15.20 (pid {proc.pid}) with SIGKILL {where}, "
          f"{time.perf_counter() - t1:.1f} s after it started")
    after = snapshot()
    with read_session(engine) as s:
        problems = verify_store(s)
    ok = after == before and not problems
    print(f"after the kill: {after}  (before: {before})")
    print(f"  same as before the kill: {after == before}; consistency problems: {problems or 'none'}")
    t2 = time.perf_counter()
    second = ingest("15.20")
    with read_session(engine) as s:
        problems2 = verify_store(s)
    print(f"restarted ingest of 15.20: revision {second['revision']}, counts {second['counts']} "
          f"({time.perf_counter() - t2:.1f} s); consistency problems: {problems2 or 'none'}")
    ok = ok and second["revision"] == before["latest_revision"] + 1 and not problems2
    print("OK" if ok else "FAILED")
    engine.dispose()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
