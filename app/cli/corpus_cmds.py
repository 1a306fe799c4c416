"""Store commands: ``ingest``, ``corpus fetch``, ``revisions list|show|verify``,
``documents show|versions``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from app.cli.common import add_json_flag, emit
from foundation.errors import UnknownDocument

EXIT_REJECTED = 2  # same code as any other bad input (app.cli.common.EXIT_CODES)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``ingest``, ``corpus fetch``, ``revisions`` and ``documents`` to the CLI."""
    ing = sub.add_parser("ingest", help="ingest files or directories as one batch (one new revision)")
    ing.add_argument("paths", nargs="+", type=Path, help=".txt .md .rst .html/.htm files or directories")
    ing.add_argument("--id", dest="document_id", default=None,
                     help="document id for a single file (default: the path relative to its root)")
    ing.add_argument("--delete-missing", action="store_true",
                     help="tombstone live documents that are not found under the given paths")
    ing.add_argument("--no-embed", action="store_true", help="store and chunk only; embed later")
    ing.add_argument("--follow-symlinks", action="store_true",
                     help="follow symbolic links that point out of a given directory (default: refuse them)")
    ing.add_argument("--note", default=None, help="a note stored with the revision")
    add_json_flag(ing)
    ing.set_defaults(func=cmd_ingest)

    corpus = sub.add_parser("corpus", help="fetch the real corpus")
    csub = corpus.add_subparsers(dest="corpus_command", metavar="ACTION")
    csub.required = True
    fetch = csub.add_parser("fetch", help="unpack the PostgreSQL 15 docs into <data_dir>/corpora/")
    fetch.add_argument("source", choices=["postgres-docs"])
    fetch.add_argument("--version", required=True, help="15.18 or 15.20")
    fetch.add_argument("--deb", type=Path, default=None, help="use this .deb instead of searching")
    add_json_flag(fetch)
    fetch.set_defaults(func=cmd_fetch)

    rev = sub.add_parser("revisions", help="corpus revisions (default action: list)")
    rsub = rev.add_subparsers(dest="revisions_command", metavar="ACTION")
    add_json_flag(rev)
    rev.set_defaults(func=cmd_revisions_list, limit=None)
    rl = rsub.add_parser("list", help="all revisions, newest first")
    rl.add_argument("--limit", type=int, default=None)
    add_json_flag(rl)
    rl.set_defaults(func=cmd_revisions_list)
    rs = rsub.add_parser("show", help="one revision and its live documents")
    rs.add_argument("number", type=int, nargs="?", default=None, help="default: the latest")
    add_json_flag(rs)
    rs.set_defaults(func=cmd_revisions_show)
    rv = rsub.add_parser("verify", help="recompute every root and check the store's invariants")
    add_json_flag(rv)
    rv.set_defaults(func=cmd_revisions_verify)

    docs = sub.add_parser("documents", help="documents and their versions")
    dsub = docs.add_subparsers(dest="documents_command", metavar="ACTION")
    dsub.required = True
    ds = dsub.add_parser("show", help="a document's current text (or --version N)")
    ds.add_argument("document_id")
    ds.add_argument("--version", type=int, default=None)
    add_json_flag(ds)
    ds.set_defaults(func=cmd_documents_show)
    dv = dsub.add_parser("versions", help="every version and tombstone of a document")
    dv.add_argument("document_id")
    add_json_flag(dv)
    dv.set_defaults(func=cmd_documents_versions)


# --- ingest ------------------------------------------------------------------------------------

def render_ingest_report(p: dict[str, Any]) -> str:
    """Human summary of an ingest report's JSON form (``IngestOutcome.to_dict``): counts, the new
    revision, timing, every rejected or skipped path with its code and reason, and notes."""
    c = p["counts"]
    head = (f"revision {p['revision']} (previous {p['previous_revision']})" if p["revision"]
            else f"no change: still at revision {p['previous_revision']}")
    lines = [f"{head}: added {c['added']}, updated {c['updated']}, unchanged {c['unchanged']}, "
             f"deleted {c['deleted']}, rejected {c['rejected']}"
             + (f", skipped {c['skipped']}" if c.get("skipped") else "")]
    if p["revision"]:
        lines.append(f"live documents {p['live_documents']}, chunks added {p['chunks_added']}, "
                     f"embeddings added {p['embeddings_added']}, root {p['root_hash']}")
    lines.append(f"took {p['timings_ms']['total_ms'] / 1000:.2f} s")
    for r in p["results"]:
        if r["status"] in ("rejected", "skipped"):
            lines.append(f"{r['status']} {r['document_id']}: [{r['code']}] {r['reason']}")
    for note in p.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def cmd_ingest(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget ingest PATH...``: one batch; exit 2 when any file was rejected."""
    from app.ingest import IngestService

    outcome = IngestService(services).ingest_paths(args.paths, document_id=args.document_id,
                                                   delete_missing=args.delete_missing,
                                                   embed=not args.no_embed, note=args.note, progress=True,
                                                   follow_symlinks=args.follow_symlinks)
    emit(args, outcome.to_dict(), render_ingest_report)
    return EXIT_REJECTED if outcome.report.counts["rejected"] else 0


# --- corpus fetch ----------------------------------------------------------------------------------

def cmd_fetch(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget corpus fetch postgres-docs --version V``: unpack the docs; print their folder."""
    from app.ingest import IngestService

    result = IngestService(services).fetch_postgres_docs(args.version, deb=args.deb)
    emit(args, result.to_dict(), lambda p: p["path"])
    if not args.json:
        print(f"{result.pages} pages of PostgreSQL {result.version} docs from {result.deb}"
              f"{' (already unpacked)' if result.reused else ''}", file=sys.stderr)
    return 0


# --- revisions and documents --------------------------------------------------------------------------

def cmd_revisions_list(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget revisions [list]``: every revision, newest first (``--limit``)."""
    from foundation.db import read_session
    from retrieval.store import list_revisions

    with read_session(services.engine) as s:
        revs = [r.to_dict() for r in list_revisions(s, limit=args.limit, newest_first=True)]

    def human(rows: list[dict[str, Any]]) -> str:
        if not rows:
            return "no revisions yet"
        out = [f"{'rev':>5}  {'created_at':32}  {'live':>6}  {'+add':>5}  {'~upd':>5}  {'-del':>5}  root"]
        for r in rows:
            out.append(f"{r['number']:>5}  {r['created_at']:32}  {r['live_documents']:>6}  {r['added']:>5}  "
                       f"{r['updated']:>5}  {r['deleted']:>5}  {r['root_hash'][:23]}  {r['note'] or ''}")
        return "\n".join(out)

    emit(args, revs, human)
    return 0


def cmd_revisions_show(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget revisions show [N]``: one revision (default the latest) and its live documents."""
    from foundation.db import read_session
    from retrieval.store import get_revision, latest_revision, state_at

    with read_session(services.engine) as s:
        number = args.number if args.number is not None else latest_revision(s)
        info = get_revision(s, number).to_dict()
        info["documents"] = [{"document_id": v.document_id, "version": v.version,
                              "content_hash": v.content_hash} for v in state_at(s, number)]

    def human(p: dict[str, Any]) -> str:
        out = [f"revision {p['number']} at {p['created_at']}: {p['live_documents']} live documents "
               f"(+{p['added']} ~{p['updated']} -{p['deleted']} ={p['unchanged']}), root {p['root_hash']}"]
        out += [f"  {d['document_id']} v{d['version']} {d['content_hash'][:23]}" for d in p["documents"]]
        return "\n".join(out)

    emit(args, info, human)
    return 0


def cmd_revisions_verify(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget revisions verify``: recompute every root hash and check the store's invariants;
    exit 4 when anything is inconsistent."""
    from foundation.db import read_session
    from retrieval.store import latest_revision, verify_store

    with read_session(services.engine) as s:
        problems = verify_store(s)
        head = latest_revision(s)
    emit(args, {"revision": head, "ok": not problems, "problems": problems},
         lambda p: f"store consistent at revision {p['revision']}" if p["ok"]
         else "\n".join(["store INCONSISTENT:"] + [f"  {x}" for x in p["problems"]]))
    return 0 if not problems else 4


def cmd_documents_show(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget documents show ID [--version N]``: a version's text (default: the live one)."""
    from foundation.db import read_session
    from retrieval.store import get_document, get_version

    with read_session(services.engine) as s:
        if args.version is not None:
            payload = get_version(s, args.document_id, args.version).to_dict()
        else:
            doc = get_document(s, args.document_id)
            if doc.current is None:
                raise UnknownDocument(f"document {args.document_id!r} was deleted (version "
                                      f"{doc.latest_version} is a tombstone); use --version N",
                                      document_id=args.document_id)
            payload = doc.current.to_dict()

    def human(p: dict[str, Any]) -> str:
        return (f"{p['document_id']} v{p['version']} {p['content_hash']} (live from revision "
                f"{p['live_from_revision']}, until {p['live_until_revision'] or '-'}), "
                f"{p['n_chunks']} chunks\n\n{p['text'] or '(tombstone)'}")

    emit(args, payload, human)
    return 0


def cmd_documents_versions(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget documents versions ID``: every version and tombstone, oldest first."""
    from foundation.db import read_session
    from retrieval.store import list_versions

    with read_session(services.engine) as s:
        versions = [v.to_dict() for v in list_versions(s, args.document_id)]

    def human(rows: list[dict[str, Any]]) -> str:
        return "\n".join(
            f"v{r['version']:<4} {'TOMBSTONE' if r['is_tombstone'] else r['content_hash'][:23]:23}  "
            f"live {r['live_from_revision']}..{r['live_until_revision'] or ''}" for r in rows)

    emit(args, versions, human)
    return 0
