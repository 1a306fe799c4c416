"""Console benchmark: server time of the receipt page on a real data directory.

Usage::

    python -m benchmarks.ui_receipt_page --data-dir COPY_OF_DATA_DIR [--receipts 20] [--rounds 5]

Opens the data directory's database (a copy: the script creates an operator key in it),
builds the real app, signs in through the console's form, then loads
``/ui/receipts/{id}`` for up to ``--receipts`` receipts, ``--rounds`` times each,
round-robin over the receipts (so no page is timed twice in a row). The server time is
the page's own ``Server-Timing: app;dur=`` (handler, services, template: everything
from routing to the finished HTML); the in-process wall time of the request is printed
beside it. The very first request of the process (template compilation) is reported
apart. The receipt page needs no model, so none is loaded.

Prints the CPU model, core count and load average before and after; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import cpu_model, quantile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="a COPY of a ragbudget data directory")
    ap.add_argument("--receipts", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    from fastapi.testclient import TestClient

    from app.api.app import create_app
    from app.auth import create_key
    from app.services import Services
    from app.settings import get_settings
    from receipts.chain import get_receipt, list_receipts

    print(f"# machine: {cpu_model()} | cores {os.cpu_count()} | loadavg at start "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    services = Services(get_settings(data_dir=args.data_dir, auth_enabled=True))
    app = create_app(services=services)
    rows, _ = list_receipts(services.engine, limit=max(1, args.receipts))
    if not rows:
        print("no receipts in this data directory", file=sys.stderr)
        return 1
    _, key = create_key(services.engine, "operator", "ui benchmark")
    server_ms: list[float] = []
    wall_ms: list[float] = []
    with TestClient(app) as client:
        page = client.get("/ui/login").text
        token = re.search(r'name="csrf_token" value="([^"]+)"', page)
        assert token is not None
        client.post("/ui/login", data={"csrf_token": token.group(1), "api_key": key})
        first_t = time.perf_counter()
        first = client.get(f"/ui/receipts/{rows[0]['id']}")
        first_wall = (time.perf_counter() - first_t) * 1000.0
        first_server = float(first.headers["server-timing"].split("dur=")[1])
        sizes = []
        for _ in range(args.rounds):
            for r in rows:
                t = time.perf_counter()
                resp = client.get(f"/ui/receipts/{r['id']}")
                wall_ms.append((time.perf_counter() - t) * 1000.0)
                if resp.status_code != 200:
                    print(f"{r['id']}: HTTP {resp.status_code}", file=sys.stderr)
                    return 1
                server_ms.append(float(resp.headers["server-timing"].split("dur=")[1]))
                sizes.append(len(resp.content))
    n_cands = statistics.median(len(get_receipt(services.engine, r["id"]).get("candidates") or [])
                                for r in rows)
    print(f"# data: {args.data_dir} | receipts {len(rows)} (median {n_cands:g} candidates) | "
          f"rounds {args.rounds} | page size median {statistics.median(sizes) / 1024:.0f} KiB")
    print(f"first request of the process (templates compiled): server {first_server:.1f} ms, "
          f"wall {first_wall:.1f} ms")
    print(f"receipt page server time over {len(server_ms)} loads: p50 {statistics.median(server_ms):.1f} ms, "
          f"p95 {quantile(server_ms, 0.95):.1f} ms, max {max(server_ms):.1f} ms")
    print(f"in-process wall time: p50 {statistics.median(wall_ms):.1f} ms, "
          f"p95 {quantile(wall_ms, 0.95):.1f} ms")
    print(f"# loadavg at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    services.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
