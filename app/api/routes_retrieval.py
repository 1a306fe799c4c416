"""``POST /v1/retrieve``: exact, version-pinned top-k chunks (role copilot).

Chunk texts are returned only to operators and admins; a copilot gets the
ranked hits (ids, versions, hashes, offsets, scores) without ``text``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from app.answering.types import ChunkHit
from app.api.deps import get_services, require_role
from app.api.routes_answer import MAX_REVISION
from app.auth import Principal
from app.services import Services
from app.validation import check_query

router = APIRouter(tags=["retrieval"])


class RetrieveCreate(BaseModel):
    """A retrieval request; ``revision`` defaults to the latest corpus revision."""

    # JSON types as documented (no true -> 1, no "5" -> 5); unknown fields are rejected.
    model_config = ConfigDict(strict=True, extra="forbid")
    query: str = Field(..., max_length=100_000)
    k: int = Field(8, description="hits to return, 1..max_k")
    revision: int | None = Field(None, ge=0, le=MAX_REVISION,
                                 description="corpus revision to search (default: latest)")


class HitPublic(ChunkHit):
    """One ranked chunk of ``POST /v1/retrieve`` (``retrieval.retriever.Hit``).

    ``rank``: 1-based position; ``score``: the exact float32 inner product of the query and
    chunk embeddings (unit vectors, so cosine similarity, -1..1); ``document_id``,
    ``version``: the document version the chunk belongs to; ``chunk_hash``: ``sha256:`` of
    the chunk text; ``start_char`` / ``end_char``: the chunk's span in the version's
    normalised text (Python string indices, end exclusive); ``n_tokens``: the chunk's length
    in generator tokens; ``text``: the chunk text, for operators and admins only.
    """

    start_char: int
    end_char: int
    n_tokens: int
    text: str | None = Field(None, description="operator and admin only")


class RetrievalPublic(BaseModel):
    """Everything that determines (and describes) one retrieval.

    ``revision``: the corpus revision searched; ``root_hash``: that revision's root hash;
    ``embedder_id`` / ``embedder``: the query embedder's id and identity (model, backend,
    versions); ``index``: the FAISS index parameters; ``k``: hits asked for;
    ``query_truncated``: the query was longer than the embedder's word-piece limit and
    was cut; ``query_wordpieces``: the query's length in embedder word pieces;
    ``hits``: ranked by (-score, chunk id); ``timings_ms``: ``embed``, ``search``, ``fetch``
    and ``total`` wall times in milliseconds.
    """

    revision: int
    root_hash: str | None
    embedder_id: str
    embedder: dict[str, Any]
    index: dict[str, Any]
    k: int
    query_truncated: bool
    query_wordpieces: int
    hits: list[HitPublic]
    timings_ms: dict[str, float]


@router.post("/v1/retrieve", response_model=RetrievalPublic)
def retrieve(body: RetrieveCreate, principal: Principal = Depends(require_role("copilot")),
             services: Services = Depends(get_services)) -> JSONResponse:
    """Exact top-k over the chunks live at ``revision``; ties by chunk id; scores as float32.

    Errors: 422 ``empty_query`` / ``invalid_k``, 413 ``query_too_long``, 404 ``unknown_revision``.
    """
    check_query(services.settings, body.query, body.k)
    result = services.retriever.retrieve(body.query, body.k, body.revision)
    # A JSONResponse keeps each float's shortest repr (the exact float32 value) and lets a
    # copilot's hits leave ``text`` out rather than carry null.
    return JSONResponse(result.to_dict(include_text=principal.allows("operator")))
