"""Receipt benchmarks: write cost per answer, chain verification speed, replay time.

Usage::

    python -m benchmarks.receipts [--appends 200] [--chain 100000] [--replays 50] [--json]

* write: median / p95 ms of :func:`receipts.chain.append_receipt` for a realistic
  body (K=16 candidates, 17 plan rows, 64 output tokens), one after another, on a
  fresh SQLite file (WAL, ``synchronous=NORMAL``), including the transaction and
  the ``receipt_documents`` rows.
* verify: a valid chain of ``--chain`` receipts is bulk-inserted (bodies and hashes
  computed here, then batched inserts in one transaction), and
  :func:`receipts.verify.verify_chain` walks it: receipts/s. Chains of format
  version 1 (Python's canonical JSON) and version 2 (RFC 8785) are built and
  verified alternately, ``--verify-rounds`` times each (1 2 1 2 ...), so their
  ratio is measured under the same load.
* replay: :func:`receipts.replay.replay` without regeneration over a small store
  written straight into the tables with a deterministic fake retriever
  (``ragbudget_testing/synthetic_receipts.py``): the receipts side of replay (hash and link,
  pinned-revision root, re-run retrieval, stored chunks, prompt rebuild, freshness).
  With the real retriever add its own ``retrieve`` latency (benchmarks/retrieve.py).

Timings use ``time.perf_counter()``. Numbers are for comparison on one machine;
the script prints them with the CPU model and the load average before and after,
and asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, insert

from app.db import open_database
from app.settings import get_settings
from benchmarks.common import cpu_model, elapsed_ms
from foundation.db import WriterLock, write_transaction
from foundation.hashing import sha256_ints, sha256_text
from ragbudget_testing.synthetic_receipts import candidate, sections
from receipts.canonical import canonical_body, receipt_hash
from receipts.chain import GENESIS, append_receipt
from receipts.models import ReceiptDocument, ReceiptRow
from receipts.replay import replay
from receipts.schema import (
    build_receipt_body,
    document_versions,
)
from receipts.verify import verify_chain


def realistic_body(i: int = 0) -> dict[str, Any]:
    """A body the size of a real answer's: K=16, 17 plan rows, 64 output tokens."""
    s = sections(question=f"How do I configure continuous WAL archiving with archive_command? #{i}",
                 candidates=[candidate(r, f"html/page-{(r * 7 + i) % 900}.html", 1 + r % 3,
                                       0.8 - r * 0.0123456789, chunk_id=10_000 * r + i % 997)
                             for r in range(1, 17)], chosen_k=6)
    s["plan"]["rows"] = [{"k": k, "prompt_tokens": 180 + 130 * k, "cached_tokens": 120,
                          "computed_tokens": 60 + 130 * k, "ttft_p50_ms": 40.0 + 55.5 * k,
                          "ttft_p95_ms": 48.0 + 61.25 * k, "fits_budget": k < 7, "fits_context": True}
                         for k in range(17)]
    ids = list(range(1000 + i % 50, 1064 + i % 50))
    text = "Set archive_mode to on and archive_command to a shell command that copies %p. " * 4
    s["output"] = {"text": text, "text_hash": sha256_text(text), "token_ids_hash": sha256_ints(ids),
                   "output_tokens": len(ids), "token_ids": ids, "finish_reason": "length",
                   "stop_sequence": None}
    return build_receipt_body(**s)


def open_tmp(root: Path, name: str) -> Engine:
    return open_database(get_settings(data_dir=root / name, auth_enabled=False))


def bench_write(root: Path, n: int) -> dict[str, Any]:
    engine = open_tmp(root, "write")
    template = realistic_body()
    times = []
    for _ in range(n):
        b = copy.deepcopy(template)
        t0 = time.perf_counter()
        append_receipt(engine, b)
        times.append(elapsed_ms(t0))
    engine.dispose()
    times.sort()
    return {"appends": n, "body_bytes": len(canonical_body(template)),
            "median_ms": round(statistics.median(times), 3),
            "p95_ms": round(times[int(0.95 * (n - 1))], 3)}


def bulk_chain(engine: Engine, n: int, version: int, batch: int = 5000) -> float:
    """Insert a valid chain of ``n`` realistic receipts of format ``version`` (1 or 2); seconds taken.

    A version-1 body is the same content with integer chunk ids, as version 1 wrote them.
    """
    t0 = time.perf_counter()
    template = realistic_body()
    if version == 1:
        for cand in template["candidates"]:
            cand["chunk_id"] = int(cand["chunk_id"])
    prev = GENESIS
    with write_transaction(engine, WriterLock.RECEIPTS) as session:
        for start in range(1, n + 1, batch):
            rows, docs = [], []
            for seq in range(start, min(n, start + batch - 1) + 1):
                body = dict(template, question=f"{template['question']} / {seq}",
                            id="rcpt_" + uuid.uuid4().hex, seq=seq,
                            created_at=f"2025-01-01T00:00:00.{seq % 1_000_000:06d}+00:00",
                            prev_hash=prev, format_version=version)
                digest = receipt_hash(body)
                body["hash"] = digest
                rows.append({"seq": seq, "id": body["id"], "created_at": body["created_at"],
                             "status": body["status"], "prev_hash": prev, "hash": digest,
                             "body": canonical_body(body).decode("utf-8")})
                docs += [{"receipt_seq": seq, "document_id": d, "version": v}
                         for d, v in document_versions(body)]
                prev = digest
            session.execute(insert(ReceiptRow), rows)
            session.execute(insert(ReceiptDocument), docs)
    return time.perf_counter() - t0


def bench_verify(root: Path, n: int, rounds: int) -> dict[str, Any]:
    """Verify chains of version 1 and version 2 alternately; receipts/s per version and their ratio."""
    out: dict[str, Any] = {"receipts": n, "rounds": rounds}
    per: dict[int, list[float]] = {1: [], 2: []}
    ok = True
    for r in range(rounds):
        for version in (1, 2):
            name = f"verify-v{version}-{r}"
            engine = open_tmp(root, name)
            bulk_chain(engine, n, version)
            t0 = time.perf_counter()
            report = verify_chain(engine)
            per[version].append(n / (time.perf_counter() - t0))
            ok = ok and report.ok
            engine.dispose()
            if version == 2 and r == 0:
                out["db_mb"] = round(sum(p.stat().st_size for p in (root / name).glob("ragbudget.db*"))
                                     / 2**20, 1)
    for version, rates in per.items():
        out[f"v{version}_receipts_per_s"] = round(statistics.median(rates))
    out["v2_over_v1"] = round(statistics.median(per[2]) / statistics.median(per[1]), 3)
    out["ok"] = ok
    return out


def bench_replay(root: Path, n: int) -> dict[str, Any]:
    from ragbudget_testing.synthetic_receipts import (
        FakeRetriever,
        answer_body,
        make_revision_1,
        make_revisions_2_3,
        rebuild_prompt,
    )

    engine = open_tmp(root, "replay")
    make_revision_1(engine)
    retriever = FakeRetriever(engine)
    ids = [append_receipt(engine, answer_body(retriever, question=f"question {i}")).id for i in range(n)]
    make_revisions_2_3(engine)
    times, ok = [], True
    for rid in ids:
        t0 = time.perf_counter()
        report = replay(engine, rid, retriever=retriever, rebuild_prompt=rebuild_prompt)
        times.append(elapsed_ms(t0))
        ok = ok and report.ok
    engine.dispose()
    times.sort()
    return {"replays": n, "all_ok": ok, "median_ms": round(statistics.median(times), 3),
            "p95_ms": round(times[int(0.95 * (n - 1))], 3)}



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--appends", type=int, default=200)
    parser.add_argument("--chain", type=int, default=20_000)
    parser.add_argument("--verify-rounds", type=int, default=2)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ragbudget-bench-") as tmp:
        root = Path(tmp)
        load_before = os.getloadavg()
        result = {"machine": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                  "write": bench_write(root, args.appends),
                  "verify": bench_verify(root, args.chain, args.verify_rounds),
                  "replay": bench_replay(root, args.replays)}
        result["loadavg_before"] = [round(x, 2) for x in load_before]
        result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        print(json.dumps(result, indent=2))
        return
    w, v, r = result["write"], result["verify"], result["replay"]
    print(f"machine: {result['machine']}, {result['cores']} cores, Python {result['python']}; load average "
          f"before {result['loadavg_before']}, after {result['loadavg_after']}")
    print(f"write : {w['appends']} appends of a {w['body_bytes']} B body, median {w['median_ms']} ms, "
          f"p95 {w['p95_ms']} ms")
    print(f"verify: chains of {v['receipts']} receipts ({v['db_mb']} MiB), {v['rounds']} rounds each, "
          f"alternating: version 1 {v['v1_receipts_per_s']} receipts/s, version 2 (RFC 8785) "
          f"{v['v2_receipts_per_s']} receipts/s, ratio v2/v1 {v['v2_over_v1']} (ok={v['ok']})")
    print(f"replay: {r['replays']} replays without regeneration, median {r['median_ms']} ms, "
          f"p95 {r['p95_ms']} ms (all ok={r['all_ok']})")


if __name__ == "__main__":
    main()
