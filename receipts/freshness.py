"""Freshness: has the context a receipt was built on changed since?

For every candidate document version of a receipt (``cited`` marks the first
``chosen_k``, the ones the model was shown) this says whether that version is
still live, was superseded (by which version, at which revision) or deleted
(at which revision), from ``DocumentVersion.live_until_revision`` and the
tombstone that a deletion adds. Nothing here changes the store.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import Engine, func, select

from foundation.db import read_session
from receipts.schema import cited_candidates
from retrieval.models import DocumentVersion, Revision

STATES = ("current", "superseded", "deleted", "unknown")


def _state(versions: list[Any], version: int) -> dict[str, Any]:
    """State of ``version`` given all version rows of its document (sorted by version)."""
    live = [v for v in versions if not v.is_tombstone and v.live_until_revision is None]
    current_version = live[-1].version if live else None
    mine = next((v for v in versions if v.version == version and not v.is_tombstone), None)
    out: dict[str, Any] = {"status": "unknown", "superseded_by": None, "changed_at_revision": None,
                           "current_version": current_version}
    if mine is None:
        return out
    if mine.live_until_revision is None:
        out["status"] = "current"
        return out
    at = mine.live_until_revision
    out["changed_at_revision"] = at
    successor = next((v for v in versions if v.version > version and v.live_from_revision == at), None)
    if successor is None or successor.is_tombstone:
        out["status"] = "deleted"
    else:
        out["status"] = "superseded"
        out["superseded_by"] = successor.version
    return out


def freshness(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    """Freshness of a receipt's document versions against the store's latest revision.

    Returns:
        ``{"receipt_revision", "latest_revision", "changed" (True when any cited
        version is no longer current), "counts" ({state: n} over cited versions),
        "documents": [{"document_id", "version", "cited", "status" (one of
        :data:`STATES`), "superseded_by", "changed_at_revision", "current_version"}]}``,
        documents in first-rank order, one entry per distinct (document, version).
    """
    cited = {(c["document_id"], c["version"]) for c in cited_candidates(body)}
    pairs: list[tuple[str, int]] = []
    for cand in body.get("candidates") or []:
        pair = (cand["document_id"], cand["version"])
        if pair not in pairs:
            pairs.append(pair)
    doc_ids = sorted({d for d, _ in pairs})
    by_doc: dict[str, list[Any]] = defaultdict(list)
    with read_session(engine) as session:
        latest = session.scalar(select(func.max(Revision.number)))
        for start in range(0, len(doc_ids), 500):
            rows = session.execute(
                select(DocumentVersion.document_id, DocumentVersion.version, DocumentVersion.is_tombstone,
                       DocumentVersion.live_from_revision, DocumentVersion.live_until_revision)
                .where(DocumentVersion.document_id.in_(doc_ids[start:start + 500]))
                .order_by(DocumentVersion.document_id, DocumentVersion.version)).all()
            for row in rows:
                by_doc[row.document_id].append(row)
    documents = []
    counts = dict.fromkeys(STATES, 0)
    for doc_id, version in pairs:
        entry = {"document_id": doc_id, "version": version, "cited": (doc_id, version) in cited,
                 **_state(by_doc.get(doc_id, []), version)}
        if entry["cited"]:
            counts[entry["status"]] += 1
        documents.append(entry)
    return {
        "receipt_revision": (body.get("corpus") or {}).get("revision"),
        "latest_revision": latest,
        "changed": any(counts[s] for s in ("superseded", "deleted", "unknown")),
        "counts": counts,
        "documents": documents,
    }


def render_freshness(fresh: dict[str, Any]) -> str:
    """Human-readable freshness lines for the CLI."""
    lines = [f"freshness: receipt at revision {fresh['receipt_revision']}, "
             f"latest revision {fresh['latest_revision']}"]
    changed = [d for d in fresh["documents"] if d["status"] != "current"]
    if not changed:
        lines.append("  every cited and candidate document version is still current")
    for d in changed:
        what = {"superseded": f"superseded by v{d['superseded_by']} at revision {d['changed_at_revision']}",
                "deleted": f"deleted at revision {d['changed_at_revision']}",
                "unknown": "not found in this store"}[d["status"]]
        tag = "cited" if d["cited"] else "candidate"
        lines.append(f"  {tag:<9} {d['document_id']} v{d['version']}: {what}")
    return "\n".join(lines)
