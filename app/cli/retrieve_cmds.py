"""``ragbudget retrieve "QUERY" [--k 8] [--revision R] [--json]`` and ``ragbudget reindex [--json]``."""

from __future__ import annotations

import argparse
from typing import Any

from app.cli.common import add_json_flag, emit
from app.validation import check_query


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``retrieve`` and ``reindex`` to the top-level subparsers ``sub``."""
    r = sub.add_parser("retrieve", help="exact top-k chunks for a query at a corpus revision")
    r.add_argument("query", help="the query text")
    r.add_argument("--k", type=int, default=8, help="hits to return (default 8)")
    r.add_argument("--revision", type=int, default=None,
                   help="corpus revision to search (default: the latest)")
    add_json_flag(r)
    r.set_defaults(func=cmd_retrieve)

    x = sub.add_parser("reindex", help="rebuild the FAISS index from the database")
    add_json_flag(x)
    x.set_defaults(func=cmd_reindex)


def _render(p: dict[str, Any]) -> str:
    lines = [f"revision {p['revision']} (root {p['root_hash']}), embedder {p['embedder']['model']} "
             f"{p['embedder_id'][:19]}, {len(p['hits'])} hit(s), "
             f"{p['timings_ms']['total']:.1f} ms"]
    if p["query_truncated"]:
        lines.append(f"note: query truncated to the embedder's {p['embedder'].get('max_seq_length')} "
                     f"word pieces (it has {p['query_wordpieces']})")
    for h in p["hits"]:
        snippet = " ".join(h["text"].split())
        snippet = snippet if len(snippet) <= 160 else snippet[:157] + "..."
        lines.append(f"{h['rank']:>3}  {h['score']:.6f}  {h['document_id']} v{h['version']} "
                     f"[{h['start_char']}:{h['end_char']}] chunk {h['chunk_id']}\n     {snippet}")
    return "\n".join(lines)


def cmd_retrieve(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget retrieve QUERY``: exact top-k chunks at a revision, with scores, spans and
    snippets (all fields with ``--json``). Returns 0; a blank query or bad k raises
    ``InvalidInput`` (exit 2), an unknown revision ``UnknownRevision`` (exit 3)."""
    check_query(services.settings, args.query, args.k)
    result = services.retriever.retrieve(args.query, args.k, args.revision)
    emit(args, result.to_dict(), _render)
    return 0


def cmd_reindex(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget reindex``: rebuild the FAISS index from the database (embedding vectors not
    yet stored) and print the revision, vector count, seconds taken and path. Returns 0."""
    stats = services.retriever.reindex()
    emit(args, stats, lambda s: f"index rebuilt at revision {s['revision']}: {s['n_vectors']} vectors "
         f"({s['embedded']} newly embedded) in {s['seconds']:.2f} s -> {s['path']}")
    return 0
