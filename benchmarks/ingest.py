"""Store + chunking throughput on the real corpus (no embeddings).

    python -m benchmarks.ingest [--database-url URL] [--data-dir DIR] [--json]

Fetches the PostgreSQL 15.18 and 15.20 docs (from ../shared/corpora, else apt),
then, in one process on an empty database: ingests 15.18, ingests 15.20, and
ingests 15.20 again. For each step it prints pages, chunks written, wall time,
pages/s, chunks/s, the prepare (extract + normalise + chunk) and commit split,
and the process's peak RSS so far (``ru_maxrss``). Chunking uses the settings'
window (default 128 tokens, 16 overlap) with the generator's tokenizer and the
embedder's word-piece limit, exactly as ``ragbudget ingest --no-embed`` does.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    from app.ingest import IngestService
    from app.services import Services
    from app.settings import get_settings
    from generation.assets import generator_dir

    ap = argparse.ArgumentParser(description="store + chunking throughput on the real corpus")
    ap.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
    ap.add_argument("--data-dir", type=Path, default=None, help="default: a temporary directory")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="ragbudget-bench-"))
    defaults = get_settings()  # the converted generator lives in the usual data dir
    gen_dir = generator_dir(defaults.data_dir, defaults.generator_path)
    settings = get_settings(data_dir=data_dir, database_url=args.database_url, generator_path=str(gen_dir))
    services = Services(settings)
    service = IngestService(services)
    pages = {v: Path(service.fetch_postgres_docs(v).path) for v in ("15.18", "15.20")}
    t = time.perf_counter()
    _ = services.tokenizer  # loaded before the clock starts
    load_s = time.perf_counter() - t
    config = service.chunker_config()
    engine = services.engine
    rss_start = peak_rss_mib()
    rows: list[dict[str, Any]] = []
    for label, version in (("15.18 into empty store", "15.18"), ("15.20 on top", "15.20"),
                           ("15.20 again (no-op)", "15.20")):
        t = time.perf_counter()
        items, rejected = service.collect([pages[version]])
        report = service.ingest(items, embed=False, rejected=rejected).report
        wall_s = time.perf_counter() - t
        rows.append({"step": label, "pages": len(items) + len(rejected), "revision": report.revision,
                     "counts": report.counts, "chunks": report.chunks_added, "wall_s": round(wall_s, 2),
                     "pages_per_s": round(len(items) / wall_s, 1),
                     "chunks_per_s": round(report.chunks_added / wall_s, 1),
                     "prepare_s": round(report.timings_ms["prepare_ms"] / 1e3, 2),
                     "commit_s": round(report.timings_ms["commit_ms"] / 1e3, 2),
                     "peak_rss_mib": round(peak_rss_mib(), 1)})
    services.close()
    result = {"database": engine.dialect.name, "chunk_tokens": config.chunk_tokens,
              "overlap_tokens": config.overlap_tokens, "max_embed_tokens": config.max_embed_tokens,
              "tokenizer_load_s": round(load_s, 2), "rss_before_ingest_mib": round(rss_start, 1),
              "python": platform.python_version(), "machine": platform.machine(), "steps": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"database {result['database']}, window {config.chunk_tokens}/{config.overlap_tokens} tokens, "
          f"embed limit {config.max_embed_tokens}; tokenizers loaded in {load_s:.2f} s, "
          f"RSS before ingest {rss_start:.0f} MiB")
    print(f"{'step':24} {'pages':>6} {'rev':>4} {'add':>5} {'upd':>5} {'same':>5} {'chunks':>7} "
          f"{'wall s':>7} {'pages/s':>8} {'chunks/s':>9} {'prep s':>7} {'commit s':>8} {'peak MiB':>9}")
    for r in rows:
        c = r["counts"]
        print(f"{r['step']:24} {r['pages']:>6} {r['revision'] or '-':>4} {c['added']:>5} {c['updated']:>5} "
              f"{c['unchanged']:>5} {r['chunks']:>7} {r['wall_s']:>7} {r['pages_per_s']:>8} "
              f"{r['chunks_per_s']:>9} {r['prepare_s']:>7} {r['commit_s']:>8} {r['peak_rss_mib']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
