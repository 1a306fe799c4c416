"""The API key check in process, on both stores, same run: ``app.auth.authenticate`` p50 / p95.

SQLite holds the ``api_keys`` rows in memory (``app.auth.SqliteKeyTable``, re-read when another
connection commits); PostgreSQL reads the key's row on every check. A valid key and one with a
wrong secret (same key id) are timed separately: they should cost the same (HMAC-SHA256 and a
constant-time compare either way). 20 warm-up checks, then ``--checks`` timed, each side.

    python -m benchmarks.auth_check [--pg postgresql+psycopg://postgres@127.0.0.1:5432/test]

The PostgreSQL side runs in a fresh schema, dropped afterwards; without a reachable server it
is skipped. Prints JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from app.auth import authenticate, create_key
from app.db import open_database
from app.settings import get_settings
from benchmarks.common import elapsed_ms
from foundation.errors import RagBudgetError


def timed(url: str, data: Path, checks: int) -> dict[str, dict[str, float]]:
    """``{"valid" | "wrong_secret": {"p50_ms", "p95_ms"}}`` of ``checks`` key checks on ``url``."""
    engine = open_database(get_settings(data_dir=data, database_url=url, auth_enabled=True))
    _, key = create_key(engine, "copilot", "key check benchmark")
    wrong = key[:-4] + ("aaaa" if key[-4:] != "aaaa" else "bbbb")
    out: dict[str, dict[str, float]] = {}
    for name, presented in (("valid", key), ("wrong_secret", wrong)):
        times: list[float] = []
        for i in range(20 + checks):
            t0 = time.perf_counter()
            # The wrong secret is refused (Unauthorized); a valid key must pass.
            with contextlib.suppress(RagBudgetError) if name == "wrong_secret" else contextlib.nullcontext():
                authenticate(engine, presented)
            if i >= 20:
                times.append(elapsed_ms(t0))
        times.sort()
        out[name] = {"p50_ms": times[len(times) // 2], "p95_ms": times[int(len(times) * 0.95)]}
    engine.dispose()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/test",
                    help="PostgreSQL URL (a fresh schema is made in it and dropped)")
    ap.add_argument("--checks", type=int, default=500, help="timed checks per side, after 20 warm-up")
    args = ap.parse_args(argv)
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        res["sqlite"] = timed(f"sqlite:///{d}/ragbudget.db", Path(d) / "data", args.checks)
        schema = "bench_" + uuid.uuid4().hex[:12]
        admin = create_engine(args.pg, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as c:
                c.execute(text(f'CREATE SCHEMA "{schema}"'))
        except Exception as exc:  # no server: report SQLite alone
            res["postgresql"] = f"skipped: {type(exc).__name__}"
        else:
            try:
                res["postgresql"] = timed(f"{args.pg}?options=-csearch_path%3D{schema}", Path(d) / "pg",
                                          args.checks)
            finally:
                with admin.connect() as c:
                    c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
