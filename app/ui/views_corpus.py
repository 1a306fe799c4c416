"""The corpus in the console: revisions, what each changed, a document's versions and their diff.

``GET /ui/corpus`` (revisions with counts and root hashes, newest first),
``GET /ui/corpus/revisions/{n}`` (the versions and tombstones that revision made),
``GET /ui/corpus/documents?id=...`` (look-up), ``GET /ui/corpus/documents/{id}?a=&b=``
(every version, and a line diff between versions ``a`` and ``b``). Reads go through
:mod:`retrieval.revisions`, the functions behind ``/v1/revisions`` and ``/v1/documents``.
"""

from __future__ import annotations

import difflib
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Path, Query, Request
from starlette.responses import RedirectResponse, Response

from app.services import Services
from app.ui.web import ConsoleRoute, ConsoleUser, console_user, get_services, render
from foundation.db import read_session
from foundation.errors import InvalidInput

router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)

REVISIONS_PER_PAGE = 50
CHANGES_PER_PAGE = 200
MAX_DIFF_LINES = 4000
_INT32 = 2**31 - 1


@router.get("/ui/corpus")
def corpus(request: Request, page: int = Query(1, ge=1, le=_INT32), user: ConsoleUser = Depends(console_user),
           services: Services = Depends(get_services)) -> Response:
    """Revisions newest first (:data:`REVISIONS_PER_PAGE` a page) and a document look-up form."""
    from retrieval.revisions import latest_revision, list_revisions

    with read_session(services.engine) as s:
        latest = latest_revision(s)
        revisions = list_revisions(s, limit=REVISIONS_PER_PAGE, offset=(page - 1) * REVISIONS_PER_PAGE,
                                   newest_first=True)
    more = latest - page * REVISIONS_PER_PAGE > 0
    return render(request, "corpus.html", user=user, section="corpus", latest=latest, revisions=revisions,
                  page=page, more=more)


@router.get("/ui/corpus/revisions/{number}")
def revision(request: Request, number: int = Path(..., ge=1, le=_INT32),
             offset: int = Query(0, ge=0, le=_INT32), user: ConsoleUser = Depends(console_user),
             services: Services = Depends(get_services)) -> Response:
    """One revision: counts, root hash and the versions/tombstones it made. 404 ``unknown_revision``."""
    from retrieval.revisions import changes_at, get_revision

    with read_session(services.engine) as s:
        info = get_revision(s, number)
        changes = changes_at(s, number, limit=CHANGES_PER_PAGE + 1, offset=offset)
    more = len(changes) > CHANGES_PER_PAGE
    return render(request, "revision.html", user=user, section="corpus", info=info,
                  changes=changes[:CHANGES_PER_PAGE], offset=offset, more=more, per_page=CHANGES_PER_PAGE)


@router.get("/ui/corpus/documents")
def find_document(ident: str = Query("", alias="id", max_length=1024),
                  user: ConsoleUser = Depends(console_user)) -> Response:
    """Redirect the look-up form to the document's page."""
    ident = ident.strip()
    if not ident:
        return RedirectResponse("/ui/corpus", status_code=303)
    return RedirectResponse("/ui/corpus/documents/" + quote(ident, safe="/"), status_code=303)


def diff_lines(old: str, new: str) -> tuple[list[dict[str, str]], dict[str, int], bool]:
    """A unified line diff (3 lines of context) of two texts.

    Returns ``(lines, counts, truncated)``: each line ``{"kind": "hunk"|"add"|"del"|"ctx",
    "text"}``; ``counts`` has ``added`` and ``removed`` line totals; at most
    :data:`MAX_DIFF_LINES` lines are returned (``truncated`` then True).
    """
    lines: list[dict[str, str]] = []
    counts = {"added": 0, "removed": 0}
    for raw in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=3):
        if raw.startswith(("---", "+++")) and not lines:
            continue
        kind = {"@": "hunk", "+": "add", "-": "del"}.get(raw[:1], "ctx")
        if kind == "add":
            counts["added"] += 1
        elif kind == "del":
            counts["removed"] += 1
        if len(lines) < MAX_DIFF_LINES:
            lines.append({"kind": kind, "text": raw})
    return lines, counts, len(lines) >= MAX_DIFF_LINES and counts["added"] + counts["removed"] > 0


def _pick(value: str, name: str) -> int | None:
    value = value.strip()
    if not value:
        return None
    if not value.isdigit() or not 1 <= int(value) <= _INT32:
        raise InvalidInput(f"{name} must be a version number", field=name)
    return int(value)


@router.get("/ui/corpus/documents/{document_id:path}")
def document(request: Request, document_id: str, a: str = Query("", max_length=12),
             b: str = Query("", max_length=12), user: ConsoleUser = Depends(console_user),
             services: Services = Depends(get_services)) -> Response:
    """A document's versions (and tombstones) and the diff from version ``a`` to ``b``
    (default: the two newest versions with text). 404 ``unknown_document`` / ``unknown_version``."""
    from retrieval.revisions import get_version, list_versions

    with read_session(services.engine) as s:
        versions = list_versions(s, document_id)
        texts = [v.version for v in versions if not v.is_tombstone]
        va, vb = _pick(a, "a"), _pick(b, "b")
        if va is None and vb is None and len(texts) >= 2:
            va, vb = texts[-2], texts[-1]
        diff: dict[str, Any] | None = None
        if va is not None and vb is not None:
            old, new = get_version(s, document_id, va), get_version(s, document_id, vb)
            if old.is_tombstone or new.is_tombstone:
                raise InvalidInput("a tombstone has no text to compare",
                                   field="a" if old.is_tombstone else "b")
            lines, counts, truncated = diff_lines(old.text or "", new.text or "")
            diff = {"a": va, "b": vb, "lines": lines, "counts": counts, "truncated": truncated,
                    "same": old.content_hash == new.content_hash}
    return render(request, "document.html", user=user, section="corpus", document_id=document_id,
                  versions=versions, text_versions=texts, diff=diff)
