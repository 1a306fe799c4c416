"""Documents and corpus revisions.

* ``POST /v1/documents`` (admin): ingest one document as one batch (one revision if it changed).
* ``DELETE /v1/document?id=ID`` (admin): tombstone a live document (one revision).
* ``GET /v1/document?id=ID``, ``GET /v1/document/versions?id=ID``,
  ``GET /v1/document/versions/{n}?id=ID`` (operator: they return text).
* ``GET /v1/revisions``, ``GET /v1/revisions/{r}`` (copilot): revisions and their live documents.

Document ids may contain ``/`` (``guides/setup.md``) and may end in a route word
(``runbooks/versions``), so the id travels in the ``id`` query parameter: every
valid id (``retrieval.document_ids``) reaches its document from curl, httpx,
requests or a browser, which all leave a query string as it is (they normalise
only the path). The path forms ``/v1/documents/{id}``, ``.../{id}/versions`` and
``.../{id}/versions/{n}`` stay for ids where they are unambiguous: the
``versions`` routes are matched first, so an id whose last segment is
``versions`` (or ``versions/<n>``) is reachable through the query form only.
Lookups use the id's NFC form.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import get_services, require_role
from app.ingest import IngestService
from app.services import Services
from foundation.errors import (
    EmptyContent,
    InvalidEncoding,
    InvalidInput,
    RagBudgetError,
    TooLarge,
    UnknownDocument,
    UnsupportedType,
)
from retrieval.document_ids import check_document_id
from retrieval.store import IngestItem, ItemResult

router = APIRouter(tags=["documents"])

_ERRORS: dict[str, type[RagBudgetError]] = {
    "too_large": TooLarge, "unsupported_type": UnsupportedType, "invalid_encoding": InvalidEncoding,
    "empty_content": EmptyContent, "unknown_document": UnknownDocument,
}
_INT32 = 2**31 - 1


class DocumentCreate(BaseModel):
    """One document to ingest. ``kind: html`` extracts the visible text of ``text``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str = Field(..., description="Stable document id; '/'-separated segments; the grammar is in "
                    "retrieval/document_ids.py (422 invalid_document_id names the rule broken)")
    text: str = Field(..., description="UTF-8 text (or HTML with kind=html); normalised before hashing")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Stored with the version")
    kind: Literal["txt", "md", "rst", "html"] = "txt"


class DocumentWritePublic(BaseModel):
    """The outcome of a write: the document's status and version, and the revision it made."""

    document_id: str
    status: Literal["added", "updated", "unchanged", "deleted"]
    version: int | None
    revision: int | None = Field(None, description="The new revision; null when nothing changed")
    previous_revision: int
    root_hash: str | None
    chunks_added: int


class VersionPublic(BaseModel):
    """A document version or tombstone. Live in revisions ``[live_from_revision,
    live_until_revision)`` (open-ended while null). ``text`` and ``n_chunks`` are set when one
    version is read, null in listings; ``source`` holds the source kind, path, byte size and
    ``sha256``; ``chunker_id`` names the chunk window and tokenizer that cut it; ``front_matter``
    is a Markdown document's YAML front matter, kept as metadata and not as text."""

    document_id: str
    version: int
    is_tombstone: bool
    content_hash: str | None
    source_hash: str | None
    chunker_id: str | None
    live_from_revision: int
    live_until_revision: int | None
    metadata: dict[str, Any]
    source: dict[str, Any]
    text: str | None = None
    n_chunks: int | None = None
    front_matter: dict[str, Any] | None = None


class DocumentPublic(BaseModel):
    """A document: the revision that created it, how many versions (tombstones included) it has,
    and its current version with text (null once deleted)."""

    id: str
    created_revision: int
    n_versions: int
    latest_version: int
    is_deleted: bool
    current: VersionPublic | None


class RevisionPublic(BaseModel):
    """A corpus revision: its number, ISO-8601 UTC creation time, the root hash over its live
    documents, how many documents are live, and what the batch that made it changed."""

    number: int
    created_at: str
    root_hash: str
    live_documents: int
    added: int
    updated: int
    deleted: int
    unchanged: int
    note: str | None


class LiveDocumentPublic(BaseModel):
    """One document live at a revision: id, version and ``sha256:`` content hash."""

    document_id: str
    version: int
    content_hash: str


class RevisionDetailPublic(RevisionPublic):
    """A revision with every document live at it."""

    documents: list[LiveDocumentPublic]


class RevisionPage(BaseModel):
    """One page of revisions, newest first, and the latest revision number (0 when empty)."""

    latest: int
    revisions: list[RevisionPublic]


def _raise_for(result: ItemResult) -> None:
    """Raise the error a rejected item's ``code`` stands for (``InvalidInput`` for other codes)."""
    cls = _ERRORS.get(result.code or "", InvalidInput)
    if cls is InvalidInput:
        raise InvalidInput(result.reason or "rejected", code=result.code or "invalid_input",
                           document_id=result.document_id)
    raise cls(result.reason or "rejected", document_id=result.document_id)


def _write(services: Services, items: list[IngestItem], delete_ids: list[str]) -> DocumentWritePublic:
    """Ingest ``items`` and delete ``delete_ids`` as one batch (at most one revision).

    Raises:
        TooLarge (``too_many_documents``, 413): more than ``max_batch_documents`` in the batch.
        InvalidInput / NotFound: the document (or the deletion) was rejected; nothing is written.
    """
    outcome = IngestService(services).ingest(items, delete_ids=delete_ids,
                                             max_documents=services.settings.max_batch_documents)
    report = outcome.report
    result = report.results[0]
    if result.status == "rejected":
        _raise_for(result)
    return DocumentWritePublic(document_id=result.document_id, status=result.status,  # type: ignore[arg-type]
                               version=result.version,
                               revision=report.revision, previous_revision=report.previous_revision,
                               root_hash=report.root_hash, chunks_added=report.chunks_added)


@router.post("/v1/documents", response_model=DocumentWritePublic, status_code=201,
             dependencies=[Depends(require_role("admin"))],
             responses={200: {"model": DocumentWritePublic, "description": "Unchanged: no new revision"}})
def create_document(body: DocumentCreate, response: Response,
                    services: Services = Depends(get_services)) -> DocumentWritePublic:
    """Ingest one document: 201 ``added``/``updated`` with the new revision, 200 ``unchanged``.

    422 ``invalid_document_id`` (``details.rule`` names the broken rule) / ``empty_content`` /
    ``invalid_encoding`` / ``unsupported_type`` / ``invalid_input``, 413 ``too_large``; nothing
    is written then.
    """
    check_document_id(body.id)
    out = _write(services, [IngestItem(body.id, text=body.text, kind=body.kind, metadata=body.metadata)], [])
    if out.status == "unchanged":
        response.status_code = 200
    return out


@router.delete("/v1/documents/{document_id:path}", response_model=DocumentWritePublic,
               dependencies=[Depends(require_role("admin"))])
def delete_document(document_id: str, services: Services = Depends(get_services)) -> DocumentWritePublic:
    """Tombstone a live document (a new revision). 404 ``unknown_document`` if it is not live."""
    return _write(services, [], [document_id])


@router.get("/v1/documents/{document_id:path}/versions/{version}", response_model=VersionPublic,
            dependencies=[Depends(require_role("operator"))])
def get_document_version(document_id: str, version: int = Path(..., ge=1, le=_INT32),
                         services: Services = Depends(get_services)) -> VersionPublic:
    """One version with its text. 404 ``unknown_document`` / ``unknown_version``."""
    from foundation.db import read_session
    from retrieval.store import get_version

    with read_session(services.engine) as s:
        return VersionPublic(**get_version(s, document_id, version).to_dict())


@router.get("/v1/documents/{document_id:path}/versions", response_model=list[VersionPublic],
            dependencies=[Depends(require_role("operator"))])
def list_document_versions(document_id: str,
                           services: Services = Depends(get_services)) -> list[VersionPublic]:
    """Every version and tombstone, oldest first, without text. 404 ``unknown_document``."""
    from foundation.db import read_session
    from retrieval.store import list_versions

    with read_session(services.engine) as s:
        return [VersionPublic(**v.to_dict()) for v in list_versions(s, document_id)]


@router.get("/v1/documents/{document_id:path}", response_model=DocumentPublic,
            dependencies=[Depends(require_role("operator"))])
def get_document(document_id: str, services: Services = Depends(get_services)) -> DocumentPublic:
    """A document and its current version's text (``current: null`` once deleted).
    404 ``unknown_document``."""
    from foundation.db import read_session
    from retrieval.store import get_document as get_doc

    with read_session(services.engine) as s:
        return DocumentPublic(**get_doc(s, document_id).to_dict())


@router.get("/v1/revisions", response_model=RevisionPage, dependencies=[Depends(require_role("copilot"))])
def list_revisions(limit: int = Query(100, ge=1, le=1000), offset: int = Query(0, ge=0, le=_INT32),
                   services: Services = Depends(get_services)) -> RevisionPage:
    """Revisions, newest first, paged by ``limit``/``offset``."""
    from foundation.db import read_session
    from retrieval.store import latest_revision
    from retrieval.store import list_revisions as list_revs

    with read_session(services.engine) as s:
        revs = list_revs(s, limit=limit, offset=offset, newest_first=True)
        return RevisionPage(latest=latest_revision(s),
                            revisions=[RevisionPublic(**r.to_dict()) for r in revs])


@router.get("/v1/revisions/{number}", response_model=RevisionDetailPublic,
            dependencies=[Depends(require_role("copilot"))])
def get_revision(number: int = Path(..., ge=1, le=_INT32),
                 services: Services = Depends(get_services)) -> RevisionDetailPublic:
    """One revision with its live documents (id, version, content hash). 404 ``unknown_revision``."""
    from foundation.db import read_session
    from retrieval.store import get_revision as get_rev
    from retrieval.store import state_at

    with read_session(services.engine) as s:
        info = get_rev(s, number)
        docs = [LiveDocumentPublic(document_id=v.document_id, version=v.version, content_hash=v.content_hash)
                for v in state_at(s, number)]
        return RevisionDetailPublic(**info.to_dict(), documents=docs)


# --- the same reads and the deletion with the id as a query parameter (any valid id) -----------------

_ID = Query(..., alias="id", description="The document id, exactly (percent-encoded in the URL)")


@router.delete("/v1/document", response_model=DocumentWritePublic,
               dependencies=[Depends(require_role("admin"))])
def delete_document_by_id(document_id: str = _ID,
                          services: Services = Depends(get_services)) -> DocumentWritePublic:
    """Tombstone the live document ``id`` (a new revision). 404 ``unknown_document`` if it is not live."""
    return delete_document(document_id, services)


@router.get("/v1/document", response_model=DocumentPublic, dependencies=[Depends(require_role("operator"))])
def get_document_by_id(document_id: str = _ID, services: Services = Depends(get_services)) -> DocumentPublic:
    """The document ``id`` and its current version's text (``current: null`` once deleted).
    404 ``unknown_document``."""
    return get_document(document_id, services)


@router.get("/v1/document/versions", response_model=list[VersionPublic],
            dependencies=[Depends(require_role("operator"))])
def list_document_versions_by_id(document_id: str = _ID,
                                 services: Services = Depends(get_services)) -> list[VersionPublic]:
    """Every version and tombstone of the document ``id``, oldest first, without text.
    404 ``unknown_document``."""
    return list_document_versions(document_id, services)


@router.get("/v1/document/versions/{version}", response_model=VersionPublic,
            dependencies=[Depends(require_role("operator"))])
def get_document_version_by_id(document_id: str = _ID, version: int = Path(..., ge=1, le=_INT32),
                               services: Services = Depends(get_services)) -> VersionPublic:
    """Version ``version`` of the document ``id``, with its text. 404 ``unknown_document`` /
    ``unknown_version``."""
    return get_document_version(document_id, version, services)
