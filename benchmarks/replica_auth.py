"""What reading the API key per request costs a replica on PostgreSQL, over HTTP, against a
cached-key baseline and against no key check, same run.

Replicas on one PostgreSQL database refuse a key revoked through any of them on the next
request because each reads the key's row on every request (``app.auth``; one indexed read).
This measures that read where a client sees it: ``GET /metrics`` with
``RAGBUDGET_METRICS_PUBLIC=false`` (a route whose only database access is the key check),
served by ``ragbudget serve``'s uvicorn set-up in three server processes on one fresh schema:

* ``per_request``: the product as it is (the key row read on every request);
* ``cached``: the same with ``app.auth._key_row`` answered from an in-process dict filled on
  first use and never invalidated: what a per-replica key cache would cost at best (it would
  miss revocations made through other replicas; a baseline, not a design);
* ``off``: auth disabled (the HTTP and route cost alone).

Blocks of ``--requests`` requests per arm, arms interleaved in a rotating order, ``--rounds``
rounds, at each client concurrency in ``--clients`` (threads, one keep-alive connection each).
Per arm and concurrency: per-request p50 / p95 ms (client wall time) and requests/s (median
over the blocks). The clients run in this process, the servers in their own, all on this machine.

    python -m benchmarks.replica_auth [--pg postgresql+psycopg://postgres@127.0.0.1:5432/test]
                                      [--clients 1 8] [--rounds 6] [--requests 300] [--out FILE]

Prints JSON (and appends it to ``--out`` as one JSONL row).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from statistics import median
from typing import Any

ARMS = ("per_request", "cached", "off")


def serve(arm: str, url: str, data_dir: Path, port: int) -> None:
    """Run one arm's server on 127.0.0.1:``port`` until killed (``--serve``)."""
    import uvicorn

    from app import auth
    from app.api.app import create_app
    from app.api.http_protocol import EnvelopeH11Protocol
    from app.services import Services
    from app.settings import get_settings

    settings = get_settings(data_dir=data_dir, database_url=url, auth_enabled=arm != "off",
                            metrics_public=False)
    if arm == "cached":
        real, cache, lock = auth._key_row, {}, threading.Lock()

        def cached_row(engine: Any, key_id: str) -> Any:
            with lock:
                if key_id not in cache:
                    cache[key_id] = real(engine, key_id)
                return cache[key_id]

        auth._key_row = cached_row  # type: ignore[assignment]
    app = create_app(services=Services(settings))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http=EnvelopeH11Protocol)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def block(url: str, key: str | None, clients: int, requests: int) -> tuple[list[float], float]:
    """``requests`` ``GET /metrics`` split over ``clients`` threads; (per-request ms, requests/s)."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    times: list[list[float]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def run(i: int) -> None:
        with httpx.Client(timeout=60) as c:
            c.get(f"{url}/metrics", headers=headers)  # open the connection outside the clock
            start.wait()
            for _ in range(requests // clients):
                t0 = time.perf_counter()
                r = c.get(f"{url}/metrics", headers=headers)
                times[i].append((time.perf_counter() - t0) * 1000.0)
                if r.status_code != 200:
                    raise RuntimeError(f"GET /metrics answered {r.status_code}: {r.text[:200]}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    flat = [x for ts in times for x in ts]
    return flat, len(flat) / wall


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    """Wait until ``url`` answers (raises RuntimeError when the server exits or never does)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"{url}/healthz", timeout=1.0)
            return
        time.sleep(0.2)
    raise RuntimeError(f"server {url} did not answer within {timeout_s:.0f} s")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the three servers on a fresh schema of ``args.pg``, time every block, drop the schema."""
    from sqlalchemy import create_engine, text

    from app.auth import create_key
    from app.db import open_database
    from app.settings import get_settings
    from benchmarks.common import machine, quantile

    schema = "bench_" + uuid.uuid4().hex[:12]
    admin = create_engine(args.pg, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = f"{args.pg}?options=-csearch_path%3D{schema}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with tempfile.TemporaryDirectory() as d:
            engine = open_database(get_settings(data_dir=Path(d) / "cli", database_url=url))
            _, key = create_key(engine, "operator", "replica auth benchmark")
            engine.dispose()
            urls: dict[str, str] = {}
            for arm in ARMS:
                port = free_port()
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.replica_auth", "--serve", arm, "--url", url,
                     "--data-dir", str(Path(d) / arm), "--port", str(port)],
                    env={**os.environ, "RAGBUDGET_OTLP_ENDPOINT": ""}))
                urls[arm] = f"http://127.0.0.1:{port}"
                wait_up(urls[arm], procs[-1])
            cells: dict[str, dict[str, Any]] = {}
            for clients in args.clients:
                times: dict[str, list[float]] = {a: [] for a in ARMS}
                rates: dict[str, list[float]] = {a: [] for a in ARMS}
                for arm in ARMS:  # warm-up block each, not recorded
                    block(urls[arm], key if arm != "off" else None, clients, min(args.requests, 50))
                for r in range(args.rounds):
                    for arm in ARMS[r % 3:] + ARMS[:r % 3]:
                        ts, rate = block(urls[arm], key if arm != "off" else None, clients, args.requests)
                        times[arm] += ts
                        rates[arm].append(rate)
                cells[str(clients)] = {arm: {"p50_ms": quantile(times[arm], 0.5),
                                             "p95_ms": quantile(times[arm], 0.95),
                                             "requests_per_s": median(rates[arm]),
                                             "requests": len(times[arm])} for arm in ARMS}
                cell = cells[str(clients)]
                cell["key_read_p50_ms"] = cell["per_request"]["p50_ms"] - cell["cached"]["p50_ms"]
                cell["throughput_ratio"] = (cell["per_request"]["requests_per_s"]
                                            / cell["cached"]["requests_per_s"])
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(15)
        with admin.connect() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
    return {"kind": "replica_auth", "route": "GET /metrics (metrics_public=false)", "rounds": args.rounds,
            "requests_per_block": args.requests, "cells": cells, "machine": machine(),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/test",
                    help="PostgreSQL URL (a fresh schema is made in it and dropped)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="client concurrencies")
    ap.add_argument("--rounds", type=int, default=6, help="blocks per arm and concurrency")
    ap.add_argument("--requests", type=int, default=300, help="requests per block")
    ap.add_argument("--out", type=Path, default=None, help="append the result as one JSONL row")
    ap.add_argument("--serve", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.url, args.data_dir, args.port)
        return 0
    result = run(args)
    if args.out is not None:
        from benchmarks.common import append_jsonl

        append_jsonl(args.out, [result])
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
