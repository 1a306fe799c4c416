"""Retrieval speed: ingest-with-embeddings throughput, and retrieve latency split into its parts.

1. Real corpus (PostgreSQL 15.18 docs, then 15.20 as one more revision), into
   a fresh SQLite database under ``<--data-dir>/retrieve-real/``:
   * ingest with embeddings (``retrieval.store.ingest_batch``) of 15.18 in
     ``--ingest-batches`` revisions: embedded chunks/s, against the embedder's
     own throughput (``embed_documents`` in the same groups of 256 that ingest
     uses) on exactly the chunk texts each batch embedded, in the same process,
     interleaved batch by batch in alternating order so both see the same load;
   * the 15.20 update as revision 2 (unchanged chunk texts are not embedded again);
   * index build and load times; latency p50/p99 of query embedding, FAISS
     search, database fetch and the whole ``retrieve`` (k=8), live and pinned
     to the last 15.18 revision, over index terms of ``bookindex.html`` as queries.
2. Synthetic corpus: ``--n-synthetic`` chunks (default 100 000) with random unit
   vectors (stored under the real embedder's id, so real query embeddings run
   against them), plus a second revision replacing 10% of the documents:
   search/fetch p50/p99 live and pinned, with 1 and 2 FAISS threads, the whole
   retrieve with a real query embedding, index build/load time and memory.

Targets on the 2-core machine: search + fetch p50 <= 5 ms at 100k chunks; whole
retrieve p50 <= 25 ms; ingest/embedder throughput ratio >= 0.9. Usage::

    python -m benchmarks.retrieve [--queries 300] [--n-synthetic 100000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import REPO
from benchmarks.retrieval_quality import (
    CORPORA,
    ingest_corpus,
    ingest_items,
    open_variant,
    parse_bookindex,
)

PARTS = ("embed", "search", "fetch", "search+fetch", "total")


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def summarize(timings: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """p50/p99 (ms) of each part over the runs."""
    out = {}
    for part in PARTS:
        if part == "search+fetch":
            xs = [t["search"] + t["fetch"] for t in timings]
        else:
            xs = [t[part] for t in timings]
        out[part] = {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99))}
    return out


def show(label: str, s: dict[str, dict[str, float]]) -> None:
    print(f"  {label:<44}" + "  ".join(f"{p} {s[p]['p50']:.2f}/{s[p]['p99']:.2f}" for p in PARTS),
          flush=True)


def run_queries(fn: Any, queries: list[Any], warmup: int = 10) -> list[dict[str, float]]:
    for q in queries[:warmup]:
        fn(q)
    return [fn(q).timings_ms for q in queries]


# --- real corpus -------------------------------------------------------------------------------

def ingest_vs_embedder(services: Any, corpus: Path, batches: int) -> dict[str, Any]:
    """Ingest ``corpus`` in ``batches`` revisions, and embed each batch's new chunk texts alone.

    The machine is shared and repeated identical embedding passes differ by up to
    +-12% here, so the two measurements are interleaved batch by batch and their
    order alternates (embedder alone first on even batches, after the ingest on
    odd ones). The texts are the batch's chunk hashes not stored before, in
    ascending order and groups of 256, exactly what ``compute_missing`` embeds;
    they are computed beforehand with the store's own extraction and chunking
    and checked against what the ingest actually stored.
    """
    from sqlalchemy import text

    from app.ingest import IngestService
    from retrieval.chunking import chunk_text
    from retrieval.store import prepare_item

    s = services.settings
    service = IngestService(services)
    items, _ = service.collect([corpus])
    emb, engine, tokenizer = services.embedder, services.engine, services.tokenizer
    config = service.chunker_config()
    sql = text("SELECT chunk_hash FROM embeddings WHERE embedder_id = :e")
    size = -(-len(items) // batches)
    tot = {"pages": 0, "chunks_added": 0, "embeddings_added": 0, "ingest_s": 0.0, "embedder_s": 0.0,
           "embedder_texts": 0, "prepare_ms": 0.0, "embed_ms": 0.0, "commit_ms": 0.0, "revision": 0,
           "batches": []}

    def embed_alone(texts: list[str]) -> float:
        t0 = time.perf_counter()
        for i in range(0, len(texts), 256):
            emb.embed_documents(texts[i:i + 256])
        return time.perf_counter() - t0

    for n, b in enumerate(range(0, len(items), size)):
        part = items[b:b + size]
        with engine.connect() as conn:
            before = {r[0] for r in conn.execute(sql, {"e": emb.embedder_id})}
        todo: dict[str, str] = {}
        for item in part:
            body = prepare_item(item, s.max_document_bytes)[0]
            for c in chunk_text(body, tokenizer, config, emb.count_wordpieces):
                if c.chunk_hash not in before:
                    todo.setdefault(c.chunk_hash, c.text)
        texts = [todo[h] for h in sorted(todo)]
        alone_s = embed_alone(texts) if n % 2 == 0 else 0.0
        ing = ingest_items(services, part, f"postgres-docs 15.18 part {n + 1}")
        if n % 2 == 1:
            alone_s = embed_alone(texts)
        with engine.connect() as conn:
            stored = {r[0] for r in conn.execute(sql, {"e": emb.embedder_id})} - before
        if stored != set(todo):
            raise RuntimeError(f"batch {n + 1}: predicted texts differ from what ingest embedded")
        tot["batches"].append({"ingest_s": ing["seconds"], "embed_in_ingest_s": ing["timings_ms"]["embed_ms"]
                               / 1000, "alone_s": alone_s, "texts": len(texts), "alone_first": n % 2 == 0})
        tot["embedder_s"] += alone_s
        tot["embedder_texts"] += len(texts)
        tot["ingest_s"] += ing["seconds"]
        tot["revision"] = ing["revision"] or tot["revision"]
        for key in ("pages", "chunks_added", "embeddings_added"):
            tot[key] += ing[key]
        for key in ("prepare_ms", "embed_ms", "commit_ms"):
            tot[key] += ing["timings_ms"][key]
    tot["embedded_chunks_per_s"] = tot["embeddings_added"] / tot["ingest_s"]
    tot["embedder_chunks_per_s"] = tot["embedder_texts"] / tot["embedder_s"]
    tot["ratio"] = tot["embedded_chunks_per_s"] / tot["embedder_chunks_per_s"]
    tot["embed_share_of_ingest"] = tot["embed_ms"] / 1000 / tot["ingest_s"]
    return tot


def bench_real(data_dir: Path, n_queries: int, batches: int) -> dict[str, Any]:

    from retrieval.corpus import fetch_postgres_docs
    from retrieval.retriever import Retriever

    old = Path(fetch_postgres_docs(data_dir, "15.18", search_dirs=[CORPORA]).path)
    new = Path(fetch_postgres_docs(data_dir, "15.20", search_dirs=[CORPORA]).path)
    work = data_dir / "retrieve-real"
    shutil.rmtree(work, ignore_errors=True)
    services = open_variant(work)
    out: dict[str, Any] = {}
    try:
        out["ingest"] = ingest_vs_embedder(services, old, batches)
        i = out["ingest"]
        print(f"  ingest 15.18 in {batches} batches: {i['pages']} pages, {i['chunks_added']} chunks, "
              f"{i['embeddings_added']} embedded in {i['ingest_s']:.1f} s -> "
              f"{i['embedded_chunks_per_s']:.1f} chunks/s; embedder alone on the same texts "
              f"{i['embedder_chunks_per_s']:.1f} chunks/s ({i['embedder_s']:.1f} s); "
              f"ratio {i['ratio']:.3f}; embedding is {i['embed_share_of_ingest']:.3f} of the ingest "
              f"time", flush=True)
        emb = services.embedder
        print("ingesting 15.20 as revision 2 ...", file=sys.stderr, flush=True)
        upd = ingest_corpus(services, new, "postgres-docs 15.20")
        out["update"] = upd
        print(f"  update to 15.20: {upd['chunks_added']} chunks added, {upd['embeddings_added']} embedded, "
              f"{upd['seconds']:.1f} s", flush=True)

        retriever = services.retriever
        t0 = time.perf_counter()
        built = retriever.sync()
        out["index_build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        loaded = Retriever(services.engine, emb, work / "index").sync()
        out["index_load_s"] = time.perf_counter() - t0
        out["index"] = {k: built[k] for k in ("n_vectors", "memory_bytes", "revision")}
        print(f"  index: {built['n_vectors']} vectors, build {out['index_build_s']:.2f} s, "
              f"load+verify {out['index_load_s']:.2f} s ({loaded['action']})", flush=True)

        evalset = parse_bookindex((new / "bookindex.html").read_text(encoding="utf-8"))
        rng = np.random.default_rng(0)
        queries = [evalset[i][0] for i in rng.choice(len(evalset), n_queries, replace=False)]
        old_rev = out["ingest"]["revision"]
        for label, rev in ((f"live (15.20, revision {upd['revision']}), k=8", None),
                           (f"pinned (15.18, revision {old_rev}), k=8", old_rev)):
            s = summarize(run_queries(lambda q, rev=rev: retriever.retrieve(q, 8, rev), queries))
            out[label] = s
            show(label, s)
    finally:
        services.close()
    return out


# --- synthetic corpus -----------------------------------------------------------------------------

def fill_synthetic(engine: Any, embedder_id: str, dim: int, n_chunks: int, seed: int = 0) -> None:
    """Revision 1: ``n_chunks`` chunks in documents of 100; revision 2 replaces 10% of the documents."""
    from sqlalchemy import insert, update

    from foundation.db import WriterLock, write_transaction
    from foundation.hashing import sha256_text
    from retrieval.embedding import ensure_embedder_record
    from retrieval.models import Chunk, Document, DocumentVersion, Embedding, Revision

    class _Rec:
        def __init__(self) -> None:
            self.embedder_id, self.identity = embedder_id, {"synthetic": True}

    rng = np.random.default_rng(seed)
    words = np.array(["vacuum", "index", "btree", "wal", "replica", "tuple", "page", "lock", "query",
                      "plan", "join", "hash", "sort", "buffer", "checkpoint", "archive", "role"])
    per_doc = 100
    n_docs = max(1, n_chunks // per_doc)
    now = "2025-01-01T00:00:00+00:00"

    def chunks_for(doc: int, version: int, version_id: int, base_id: int) -> tuple[list, list]:  # type: ignore[type-arg]
        crow, erow = [], []
        vecs = rng.standard_normal((per_doc, dim)).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        for j in range(per_doc):
            body = f"doc {doc} v{version} chunk {j}: " + " ".join(rng.choice(words, 60))
            h = sha256_text(body)
            crow.append({"id": base_id + j, "version_id": version_id, "ordinal": j, "start_char": 0,
                         "end_char": len(body), "n_tokens": 128, "chunk_hash": h, "text": body})
            erow.append({"chunk_hash": h, "embedder_id": embedder_id, "dim": dim,
                         "vector": vecs[j].astype("<f4").tobytes()})
        return crow, erow

    with write_transaction(engine, WriterLock.CORPUS) as s:
        ensure_embedder_record(s, _Rec())  # type: ignore[arg-type]
        s.execute(insert(Revision), [{"number": 1, "created_at": now, "root_hash": "sha256:" + "1" * 64,
                                      "live_documents": n_docs}])
        s.execute(insert(Document), [{"id": f"doc-{d}", "created_revision": 1} for d in range(n_docs)])
        s.execute(insert(DocumentVersion), [
            {"id": d + 1, "document_id": f"doc-{d}", "version": 1, "is_tombstone": False,
             "content_hash": None, "text": None, "live_from_revision": 1} for d in range(n_docs)])
        for d in range(n_docs):
            crow, erow = chunks_for(d, 1, d + 1, (d + 1) * 1000)
            s.execute(insert(Chunk), crow)
            s.execute(insert(Embedding), erow)
    with write_transaction(engine, WriterLock.CORPUS) as s:
        changed = list(range(0, n_docs, 10))
        s.execute(insert(Revision), [{"number": 2, "created_at": now, "root_hash": "sha256:" + "2" * 64,
                                      "live_documents": n_docs}])
        s.execute(update(DocumentVersion).where(DocumentVersion.id.in_([d + 1 for d in changed]))
                  .values(live_until_revision=2))
        s.execute(insert(DocumentVersion), [
            {"id": n_docs + d + 1, "document_id": f"doc-{d}", "version": 2, "is_tombstone": False,
             "content_hash": None, "text": None, "live_from_revision": 2} for d in changed])
        for d in changed:
            crow, erow = chunks_for(d, 2, n_docs + d + 1, (n_docs + d + 1) * 1000)
            s.execute(insert(Chunk), crow)
            s.execute(insert(Embedding), erow)


def bench_synthetic(data_dir: Path, n_chunks: int, n_queries: int) -> dict[str, Any]:
    from retrieval.retriever import Retriever

    work = data_dir / "retrieve-synthetic"
    shutil.rmtree(work, ignore_errors=True)
    services = open_variant(work)
    out: dict[str, Any] = {"n_chunks": n_chunks}
    try:
        emb = services.embedder
        engine = services.engine
        t0 = time.perf_counter()
        fill_synthetic(engine, emb.embedder_id, emb.dim, n_chunks)
        out["fill_s"] = time.perf_counter() - t0
        rss0 = rss_bytes()
        retriever = Retriever(engine, emb, work / "index")
        t0 = time.perf_counter()
        built = retriever.reindex()
        out["index_build_s"] = time.perf_counter() - t0
        out["rss_growth_bytes"] = rss_bytes() - rss0
        t0 = time.perf_counter()
        loaded = Retriever(engine, emb, work / "index").sync()
        out["index_load_s"] = time.perf_counter() - t0
        n = built["n_vectors"]
        out["index"] = {"n_vectors": n, "memory_bytes": built["memory_bytes"],
                        "memory_mib_per_100k": built["memory_bytes"] / n * 100_000 / 2**20}
        print(f"  synthetic: {n} vectors ({n_chunks} live per revision), fill {out['fill_s']:.1f} s, "
              f"build {out['index_build_s']:.2f} s, load+verify {out['index_load_s']:.2f} s "
              f"({loaded['action']}); index memory {out['index']['memory_mib_per_100k']:.1f} MiB per "
              f"100k chunks (RSS grew {out['rss_growth_bytes'] / 2**20:.0f} MiB)", flush=True)
        rng = np.random.default_rng(1)
        vecs = rng.standard_normal((n_queries, emb.dim)).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        for threads in (1, 2):
            retriever.search_threads = threads
            for label, rev, k in ((f"live, k=8, {threads} thread(s)", None, 8),
                                  (f"pinned rev 1, k=8, {threads} thread(s)", 1, 8),
                                  (f"live, k=64, {threads} thread(s)", None, 64)):
                s = summarize(run_queries(lambda v, rev=rev, k=k: retriever.retrieve_vector(v, k, rev),
                                          list(vecs)))
                out[label] = s
                show(label, s)
        retriever.search_threads = 1
        from retrieval.corpus import fetch_postgres_docs

        corpus = Path(fetch_postgres_docs(data_dir, "15.20", search_dirs=[CORPORA]).path)
        evalset = parse_bookindex((corpus / "bookindex.html").read_text(encoding="utf-8"))
        queries = [evalset[i][0] for i in rng.choice(len(evalset), n_queries, replace=False)]
        s = summarize(run_queries(lambda q: retriever.retrieve(q, 8), queries))
        out["whole retrieve, live, k=8"] = s
        show("whole retrieve (real query embedding), k=8", s)
    finally:
        services.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=REPO / "data" / "bench")
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--n-synthetic", type=int, default=100_000)
    ap.add_argument("--ingest-batches", type=int, default=16,
                    help="15.18 is ingested in this many revisions, each followed by the embedder alone")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import platform

    import faiss
    import torch

    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                           "torch": torch.__version__, "faiss": faiss.__version__},
                               "load_avg_start": os.getloadavg()}
    print(f"parts: {', '.join(PARTS)} as p50/p99 ms", flush=True)
    if not args.skip_real:
        print("real corpus (PostgreSQL 15.18 -> 15.20 docs)", flush=True)
        results["real"] = bench_real(args.data_dir, args.queries, args.ingest_batches)
    if not args.skip_synthetic:
        print(f"synthetic corpus ({args.n_synthetic} chunks, random unit vectors)", flush=True)
        results["synthetic"] = bench_synthetic(args.data_dir, args.n_synthetic, args.queries)
    results["load_avg_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
