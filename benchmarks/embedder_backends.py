"""Embedder backends side by side: ingest throughput, query latency, memory and retrieval quality.

One run, every backend on the same texts and queries, interleaved:

1. The PostgreSQL 15.20 docs are ingested once without embeddings (128:16
   chunking) into ``<data-dir>/corpus/`` (SQLite).
2. **Ingest throughput.** The distinct chunk texts are split exactly as
   ingest's ``compute_missing`` splits them (ascending chunk hash, groups of
   256). For each group every backend embeds it, in an order rotated per group
   (A B C, B C A, ...), timed with ``perf_counter``; the vectors are stored
   with ``insert_embeddings`` under each backend's embedder id, as ingest
   stores them. Resumable: a restarted run skips the groups already stored and
   keeps their timings (``<data-dir>/timings.jsonl``).
3. **Query latency.** Every book-index query is embedded alone by every
   backend (order rotated per query); p50/p99 in ms.
4. **Quality.** Each backend's vectors (of every chunk: the retriever's sync
   embeds the chunks ``--groups`` left out, untimed) go through the production
   :class:`retrieval.retriever.Retriever` (exact FAISS search, top 200 chunks,
   collapsed to pages, ``bookindex.html`` removed), scored as in
   ``benchmarks/retrieval_quality.py`` on the 3 015 queries. The quality bar:
   recall@10 within 0.005 and MRR within 0.01 of torch.
5. **Memory.** In a fresh process per backend: resident memory after loading
   the embedder and embedding one group of 256 texts and 20 queries, over the
   same process's RSS before loading (``psutil``-free: ``/proc/self/status``).

Backends: ``torch``, ``onnx``, ``onnx-int8`` (dynamic int8), ``openvino``; a suffix ``@N``
sets the document batch size (e.g. ``onnx-int8@32``; default: the backend's own).
Ratios are to torch measured in the same run. The machine (CPU model, cores)
and load average before/after are printed with the results. Usage::

    python -m benchmarks.embedder_backends --json embedders.json
    python -m benchmarks.embedder_backends --backends torch,onnx --groups 4 --queries 200 --skip-quality
    # throughput on the first 8 groups, quality (every chunk, every query) for torch and openvino:
    python -m benchmarks.embedder_backends --groups 8 --quality-backends torch,openvino
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, elapsed_ms, machine, quantile
from benchmarks.retrieval_quality import CORPORA, KS, VERSION, score_queries
from retrieval.bookindex import page_ranking, parse_bookindex

ALL_BACKENDS = ("torch", "onnx", "onnx-int8", "openvino")
GROUP = 256  # compute_missing's group size
RECALL_TOL, MRR_TOL = 0.005, 0.01


def rss_kib() -> int:
    """Resident set size of this process in KiB (``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def make_embedder(name: str, export_root: Path, threads: int) -> Any:
    """The packaged MiniLM on ``backend[-int8][@batch]``: ``torch``, ``onnx``, ``onnx-int8``,
    ``openvino``; ``@N`` sets the document batch size (default: the backend's, as the app does)."""
    from retrieval.embedding import packaged_embedder_path
    from retrieval.embedding_runtime import build_embedder, default_batch_size

    spec, _, batch = name.partition("@")
    backend, _, quant = spec.partition("-")
    return build_embedder(backend, str(packaged_embedder_path()), export_root=export_root,
                          threads=threads, quantization=quant or "none",
                          batch_size=int(batch) if batch else default_batch_size(backend))


def prepare_corpus(data_dir: Path) -> tuple[Any, Path]:
    """Services on ``<data_dir>/corpus`` with the 15.20 docs ingested once without embeddings."""
    from sqlalchemy import func, select

    from app.ingest import IngestService
    from app.services import Services
    from app.settings import get_settings
    from foundation.db import read_session
    from retrieval.corpus import fetch_postgres_docs
    from retrieval.models import Revision

    corpus_data = data_dir / "corpus"
    corpus_data.mkdir(parents=True, exist_ok=True)
    fetched = fetch_postgres_docs(data_dir, VERSION, search_dirs=[CORPORA])
    corpus_dir = Path(fetched.path)
    shared_generator = REPO / "ragbudget-data" / "models" / "smollm2-135m-instruct-fp32"  # tokenizer only
    services = Services(get_settings(
        data_dir=corpus_data, database_url=None, auth_enabled=False, chunk_tokens=128,
        chunk_overlap_tokens=16, generator_path=str(shared_generator) if shared_generator.is_dir() else None))
    with read_session(services.engine) as s:
        latest = s.execute(select(func.max(Revision.number))).scalar() or 0
    if latest == 0:
        print("ingesting the 15.20 docs without embeddings ...", file=sys.stderr, flush=True)
        IngestService(services).ingest_paths([corpus_dir], embed=False, note=f"postgres-docs {VERSION}")
    return services, corpus_dir


def chunk_texts(engine: Any) -> dict[str, str]:
    """``{chunk_hash: text}`` of every stored chunk (one revision, so all live)."""
    from sqlalchemy import select

    from foundation.db import read_session
    from retrieval.models import Chunk

    with read_session(engine) as s:
        return dict(s.execute(select(Chunk.chunk_hash, Chunk.text)).all())


def embed_phase(engine: Any, embedders: dict[str, Any], texts: dict[str, str], timings_path: Path,
                max_groups: int) -> dict[str, dict[str, float]]:
    """Embed every group with every backend (rotated order), store the vectors; return per-backend totals."""
    from foundation.db import WriterLock, read_session, write_transaction
    from retrieval.embedding import insert_embeddings, stored_hashes

    hashes = sorted(texts)
    groups = [hashes[i:i + GROUP] for i in range(0, len(hashes), GROUP)]
    if max_groups:
        groups = groups[:max_groups]
    names = list(embedders)
    done: set[tuple[int, str]] = set()
    if timings_path.is_file():
        for line in timings_path.read_text().splitlines():
            rec = json.loads(line)
            done.add((rec["group"], rec["backend"]))
    with timings_path.open("a") as log:
        for g, part in enumerate(groups):
            order = names[g % len(names):] + names[:g % len(names)]
            for name in order:
                emb = embedders[name]
                if (g, name) in done:
                    continue
                with read_session(engine) as s:
                    have = stored_hashes(s, emb.embedder_id, part)
                if len(have) == len(part):  # stored by a run whose timing line was lost: re-time nothing
                    continue
                t0 = time.perf_counter()
                vecs = emb.embed_documents([texts[h] for h in part])
                seconds = time.perf_counter() - t0
                with write_transaction(engine, WriterLock.CORPUS) as s:
                    insert_embeddings(s, emb, dict(zip(part, vecs, strict=True)))
                log.write(json.dumps({"group": g, "backend": name, "n": len(part), "seconds": seconds,
                                      "load1": os.getloadavg()[0]}) + "\n")
                log.flush()
            print(f"group {g + 1}/{len(groups)} embedded by {', '.join(order)}", file=sys.stderr, flush=True)
    totals = {n: {"texts": 0.0, "seconds": 0.0} for n in names}
    for line in timings_path.read_text().splitlines():
        rec = json.loads(line)
        if rec["backend"] in totals and rec["group"] < len(groups):
            totals[rec["backend"]]["texts"] += rec["n"]
            totals[rec["backend"]]["seconds"] += rec["seconds"]
    for t in totals.values():
        t["chunks_per_s"] = t["texts"] / t["seconds"] if t["seconds"] else 0.0
    return totals


def query_phase(embedders: dict[str, Any], queries: list[str]) -> dict[str, dict[str, float]]:
    """Embed every query alone with every backend (rotated order); p50/p99 ms per backend."""
    names = list(embedders)
    for emb in embedders.values():  # warm-up: first call allocates
        emb.embed_query("warm up")
    ms: dict[str, list[float]] = {n: [] for n in names}
    for i, q in enumerate(queries):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            embedders[name].embed_query(q)
            ms[name].append(elapsed_ms(t0))
    return {n: {"p50_ms": quantile(v, 0.5), "p99_ms": quantile(v, 0.99), "mean_ms": statistics.fmean(v),
                "n": len(v)} for n, v in ms.items()}


def quality_phase(engine: Any, embedders: dict[str, Any], evalset: list[tuple[str, set[str]]],
                  index_root: Path, n_chunks: int) -> dict[str, dict[str, float]]:
    """Book-index metrics per backend through the production retriever."""
    from retrieval.retriever import Retriever

    out: dict[str, dict[str, float]] = {}
    for name, emb in embedders.items():
        retriever = Retriever(engine, emb, index_root / name)
        info = retriever.sync()
        rankings = [page_ranking(retriever.retrieve(q, n_chunks).hits) for q, _ in evalset]
        metrics = score_queries(rankings, [p for _, p in evalset])
        metrics["n_vectors"] = float(info["n_vectors"])
        out[name] = metrics
        shown = "  ".join(f"{k} {metrics[k]:.4f}" for k in ["recall@1", "recall@10", "mrr"])
        print(f"quality {name}: {shown}", file=sys.stderr, flush=True)
    return out


def memory_child(name: str, export_root: Path, threads: int, texts_file: Path) -> None:
    """Print ``{"rss_before_kib", "rss_after_kib"}`` for one backend (runs in a fresh process)."""
    import numpy  # noqa: F401  - imported before the baseline, as in the app
    import sqlalchemy  # noqa: F401

    before = rss_kib()
    texts = json.loads(texts_file.read_text())
    emb = make_embedder(name, export_root, threads)
    emb.embed_documents(texts[:GROUP])
    for q in texts[:20]:
        emb.embed_query(q[:200])
    print(json.dumps({"rss_before_kib": before, "rss_after_kib": rss_kib()}))


def memory_phase(names: list[str], export_root: Path, threads: int, texts: list[str],
                 data_dir: Path) -> dict[str, dict[str, float]]:
    """RSS growth of loading each backend and embedding one group, each in its own process."""
    texts_file = data_dir / "memory-texts.json"
    texts_file.write_text(json.dumps(texts[:GROUP]))
    out: dict[str, dict[str, float]] = {}
    for name in names:
        res = subprocess.run([sys.executable, "-m", "benchmarks.embedder_backends", "--memory-child", name,
                              "--export-root", str(export_root), "--threads", str(threads),
                              "--texts-file", str(texts_file)],
                             capture_output=True, text=True, check=True, cwd=REPO)
        rec = json.loads(res.stdout.strip().splitlines()[-1])
        out[name] = {"rss_mib": rec["rss_after_kib"] / 1024,
                     "growth_mib": (rec["rss_after_kib"] - rec["rss_before_kib"]) / 1024}
    return out


def report(results: dict[str, Any]) -> str:
    """The side-by-side table as Markdown."""
    names = results["backends"]
    ing, qry, mem, qual = results["ingest"], results["query"], results["memory"], results["quality"]
    t = "torch"
    lines = ["| backend | ingest chunks/s | x torch | query p50 / p99 ms | x torch (p50) | RSS MiB "
             "(growth) | recall@1 | recall@10 | MRR | hit@10 | d recall@10 | d MRR | quality bar |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        q = qual.get(n, {})
        dr = q.get("recall@10", 0) - qual.get(t, {}).get("recall@10", 0) if q and t in qual else float("nan")
        dm = q.get("mrr", 0) - qual.get(t, {}).get("mrr", 0) if q and t in qual else float("nan")
        ok = "n/a" if dr != dr else "yes" if abs(dr) <= RECALL_TOL and abs(dm) <= MRR_TOL else "no"
        m = mem.get(n, {})
        lines.append(
            f"| {n} | {ing[n]['chunks_per_s']:.1f} | {ing[n]['chunks_per_s'] / ing[t]['chunks_per_s']:.2f} | "
            f"{qry[n]['p50_ms']:.2f} / {qry[n]['p99_ms']:.2f} | {qry[t]['p50_ms'] / qry[n]['p50_ms']:.2f} | "
            f"{m.get('rss_mib', float('nan')):.0f} ({m.get('growth_mib', float('nan')):.0f}) | "
            f"{q.get('recall@1', float('nan')):.4f} | {q.get('recall@10', float('nan')):.4f} | "
            f"{q.get('mrr', float('nan')):.4f} | {q.get('hit@10', float('nan')):.4f} | "
            f"{dr:+.4f} | {dm:+.4f} | {ok} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=REPO / "data" / "bench" / "embedders")
    ap.add_argument("--backends", default=",".join(ALL_BACKENDS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--groups", type=int, default=0, help="embed only the first N groups of 256 (0: all)")
    ap.add_argument("--queries", type=int, default=0, help="only the first N book-index queries (0: all)")
    ap.add_argument("--latency-queries", type=int, default=0,
                    help="time only the first N queries' embedding (0: all); quality still uses every query")
    ap.add_argument("--chunks", type=int, default=200, help="chunks retrieved per query")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--quality-backends", default="",
                    help="score quality only for these backends (comma-separated; default: all); their "
                    "missing vectors are embedded first, so quality always covers every chunk")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--export-root", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--texts-file", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    export_root = args.export_root or args.data_dir / "models"
    if args.memory_child:
        memory_child(args.memory_child, export_root, args.threads, args.texts_file)
        return 0

    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    if names[0] != "torch":
        names = ["torch"] + [n for n in names if n != "torch"]
    start = machine()
    print(f"machine: {start['cpu']}, {start['cores']} cores, load average {start['loadavg']}",
          file=sys.stderr, flush=True)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    services, corpus_dir = prepare_corpus(args.data_dir)
    engine = services.engine
    texts = chunk_texts(engine)
    t0 = time.perf_counter()
    embedders = {n: make_embedder(n, export_root, args.threads) for n in names}
    print(f"{len(embedders)} embedders ready in {time.perf_counter() - t0:.1f} s (exports included)",
          file=sys.stderr, flush=True)
    ingest = embed_phase(engine, embedders, texts, args.data_dir / "timings.jsonl", args.groups)
    evalset = parse_bookindex((corpus_dir / "bookindex.html").read_text(encoding="utf-8"))
    if args.queries:
        evalset = evalset[:args.queries]
    timed = evalset[:args.latency_queries] if args.latency_queries else evalset
    query = query_phase(embedders, [q for q, _ in timed])
    scored = [n.strip() for n in args.quality_backends.split(",") if n.strip()] or names
    unknown = sorted(set(scored) - set(names))
    if unknown:
        ap.error(f"--quality-backends names backends not benchmarked: {', '.join(unknown)}")
    quality = {} if args.skip_quality else quality_phase(
        engine, {n: embedders[n] for n in names if n in scored}, evalset, args.data_dir / "index",
        args.chunks)
    memory = memory_phase(names, export_root, args.threads, [texts[h] for h in sorted(texts)], args.data_dir)
    results = {"machine": start, "load_after": list(os.getloadavg()), "corpus": f"postgres-docs {VERSION}",
               "distinct_chunk_texts": len(texts), "queries": len(evalset), "latency_queries": len(timed),
               "backends": names,
               "embedder_ids": {n: e.embedder_id for n, e in embedders.items()},
               "identities": {n: e.identity for n, e in embedders.items()},
               "ingest": ingest, "query": query, "quality": quality, "memory": memory,
               "quality_bar": {"recall@10": RECALL_TOL, "mrr": MRR_TOL}, "ks": list(KS)}
    print(report(results))
    print(f"machine: {start['cpu']}, {start['cores']} cores; load average before {start['loadavg']}, "
          f"after {results['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    services.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
