"""Retrieval quality on the PostgreSQL 15.20 docs, labelled by the docs' own back-of-book index.

The evaluation set comes from ``bookindex.html``: every index term (a subterm
is prefixed with its parent term, "aggregate function built-in") is a query,
and the pages its entry links to are the relevant pages. Terms that only say
"see ..." (no links) are skipped; duplicate query strings are merged (union of
their pages). ``bookindex.html`` itself is removed from every ranking (it lists
every term next to its links, so it would leak the labels).

Metrics at page level: chunks are retrieved exactly (top ``--chunks`` per
query), collapsed to pages in rank order (a page ranks at its best chunk), and

* recall@k = |relevant pages in the top k pages| / |relevant pages|, averaged;
* hit@k    = share of queries with at least one relevant page in the top k;
* MRR      = mean of 1 / rank of the first relevant page (0 if none in the list).

Each chunking variant (``chunk_tokens:overlap_tokens``) is ingested into its
own data directory ``<--data-dir>/quality-<tokens>-<overlap>/`` (SQLite
database and index, reused on later runs). Usage::

    python -m benchmarks.retrieval_quality                       # 128:16, 256:32, 64:8
    python -m benchmarks.retrieval_quality --variants 128:16 --limit 300 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO
from retrieval.bookindex import page_ranking, parse_bookindex

CORPORA = REPO.parent / "shared" / "corpora"
GENERATOR_DIR = REPO / "ragbudget-data" / "models" / "smollm2-135m-instruct-fp32"
VERSION = "15.20"
KS = (1, 5, 10, 20)


def score_queries(rankings: list[list[str]], relevant: list[set[str]]) -> dict[str, float]:
    """Mean recall@k, hit@k for :data:`KS`, and MRR over the queries."""
    n = len(rankings)
    out: dict[str, float] = {"queries": float(n)}
    for k in KS:
        out[f"recall@{k}"] = sum(len(set(r[:k]) & rel) / len(rel)
                                 for r, rel in zip(rankings, relevant, strict=True)) / n
        out[f"hit@{k}"] = sum(bool(set(r[:k]) & rel) for r, rel in zip(rankings, relevant, strict=True)) / n
    mrr = 0.0
    for r, rel in zip(rankings, relevant, strict=True):
        for i, page in enumerate(r, 1):
            if page in rel:
                mrr += 1.0 / i
                break
    out["mrr"] = mrr / n
    return out


def open_variant(data_dir: Path, chunk_tokens: int = 128, overlap: int = 16) -> Any:
    """A :class:`app.services.Services` on its own data dir (SQLite database and index)."""
    from app.services import Services
    from app.settings import get_settings

    data_dir.mkdir(parents=True, exist_ok=True)
    settings = get_settings(data_dir=data_dir, database_url=None,
                            generator_path=str(GENERATOR_DIR) if GENERATOR_DIR.is_dir() else None,
                            chunk_tokens=chunk_tokens, chunk_overlap_tokens=overlap, auth_enabled=False)
    return Services(settings)


def ingest_corpus(services: Any, corpus_dir: Path, note: str) -> dict[str, Any]:
    """Ingest every page of ``corpus_dir`` with embeddings as one batch; return the report + seconds."""
    from app.ingest import IngestService

    items, rejected = IngestService(services).collect([corpus_dir])
    out = ingest_items(services, items, note)
    out["rejected"] += len(rejected)
    return out


def ingest_items(services: Any, items: list[Any], note: str) -> dict[str, Any]:
    """Ingest ``items`` (``retrieval.store.IngestItem``) with embeddings as one batch, timed."""
    from app.ingest import IngestService

    _ = services.embedder, services.tokenizer, services.engine  # loaded before the clock starts
    t0 = time.perf_counter()
    report = IngestService(services).ingest(items, note=note, progress=True).report
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "pages": len(items), "rejected": report.counts["rejected"],
            "revision": report.revision, "chunks_added": report.chunks_added,
            "embeddings_added": report.embeddings_added, "timings_ms": report.timings_ms}


def evaluate(services: Any, evalset: list[tuple[str, set[str]]], n_chunks: int) -> dict[str, Any]:
    """Run every query at the latest revision; return the metrics and per-query timing."""
    retriever = services.retriever
    retriever.sync()
    rankings, relevant = [], []
    t0 = time.perf_counter()
    truncated = 0
    for query, pages in evalset:
        res = retriever.retrieve(query, n_chunks)
        truncated += res.query_truncated
        rankings.append(page_ranking(res.hits))
        relevant.append(pages)
    seconds = time.perf_counter() - t0
    metrics = score_queries(rankings, relevant)
    metrics.update({"seconds": seconds, "revision": res.revision if evalset else 0,
                    "chunks_per_query": n_chunks, "truncated_queries": truncated,
                    "n_vectors": retriever.sync()["n_vectors"]})
    return metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=REPO / "data" / "bench")
    ap.add_argument("--variants", default="128:16,256:32,64:8",
                    help="comma-separated chunk_tokens:overlap_tokens (generator tokens)")
    ap.add_argument("--chunks", type=int, default=200, help="chunks retrieved per query")
    ap.add_argument("--limit", type=int, default=0, help="evaluate only the first N queries (0: all)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)

    from retrieval.corpus import fetch_postgres_docs

    args.data_dir.mkdir(parents=True, exist_ok=True)
    fetched = fetch_postgres_docs(args.data_dir, VERSION, search_dirs=[CORPORA])
    corpus_dir = Path(fetched.path)
    evalset = parse_bookindex((corpus_dir / "bookindex.html").read_text(encoding="utf-8"))
    if args.limit:
        evalset = evalset[: args.limit]
    n_rel = sum(len(p) for _, p in evalset)
    print(f"eval set: {len(evalset)} queries from bookindex.html, {n_rel} relevant (query, page) pairs, "
          f"{fetched.pages} pages", file=sys.stderr)
    results: dict[str, Any] = {"corpus": f"postgres-docs {VERSION}", "queries": len(evalset),
                               "relevant_pairs": n_rel, "variants": {}}
    for spec in args.variants.split(","):
        tokens, overlap = (int(x) for x in spec.split(":"))
        services = open_variant(args.data_dir / f"quality-{tokens}-{overlap}", tokens, overlap)
        try:
            from sqlalchemy import func, select

            from foundation.db import read_session
            from retrieval.models import Revision

            with read_session(services.engine) as s:
                latest = s.execute(select(func.max(Revision.number))).scalar() or 0
            ingest = None
            if latest == 0:
                print(f"ingesting {spec} ...", file=sys.stderr)
                ingest = ingest_corpus(services, corpus_dir, f"postgres-docs {VERSION}")
            metrics = evaluate(services, evalset, args.chunks)
            metrics["ingest"] = ingest
            metrics["embedder_id"] = services.embedder.embedder_id
            results["variants"][spec] = metrics
            print(f"{spec:>7}  " + "  ".join(f"{k} {metrics[k]:.3f}" for k in
                                              [f"recall@{k}" for k in KS] + ["mrr"]), flush=True)
        finally:
            services.close()
    print(json.dumps(results, indent=2, default=str))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
