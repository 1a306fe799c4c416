"""API key management: ``POST /v1/keys``, ``GET /v1/keys``, ``DELETE /v1/keys/{id}`` (admin)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import get_services, require_role
from app.auth import create_key, list_keys, revoke_key
from app.services import Services

router = APIRouter(tags=["keys"], dependencies=[Depends(require_role("admin"))])


class KeyCreate(BaseModel):
    """``POST /v1/keys``: the new key's ``role`` (``copilot`` < ``operator`` < ``admin``, each
    allowed what the roles below it are) and an optional ``name`` for people (<= 128 chars;
    empty means the role)."""

    model_config = ConfigDict(strict=True)  # JSON types as documented: no true -> 1, no "5" -> 5
    role: Literal["copilot", "operator", "admin"]
    name: str = Field("", max_length=128)


class KeyPublic(BaseModel):
    """An API key as listed: never the secret or its hash.

    ``id``: the key's public id (16 hex digits, the ``<id>`` of ``rb_<id>_<secret>``);
    ``name``: as created (the role when none was given); ``role``: as created;
    ``created_at`` / ``revoked_at``: ISO-8601 UTC times (``revoked_at`` null while the key
    is live).
    """

    id: str
    name: str
    role: str
    created_at: str | None = None
    revoked_at: str | None = None


class KeyCreated(KeyPublic):
    """``POST /v1/keys`` answer: the listing fields plus ``key``, the full key, returned this once."""

    key: str = Field(..., description="The full key; shown once, never stored")


@router.post("/v1/keys", response_model=KeyCreated, status_code=201)
def create(body: KeyCreate, services: Services = Depends(get_services)) -> KeyCreated:
    """Create a key; the response holds the full key, shown this once. 422 on an unknown role."""
    principal, key = create_key(services.engine, body.role, body.name)
    return KeyCreated(id=principal.id, name=principal.name, role=principal.role, key=key)


@router.get("/v1/keys", response_model=list[KeyPublic])
def list_(services: Services = Depends(get_services)) -> list[KeyPublic]:
    """All keys (id, name, role, created_at, revoked_at); never secrets or hashes."""
    return [KeyPublic(**k) for k in list_keys(services.engine)]  # type: ignore[arg-type]


@router.delete("/v1/keys/{key_id}", status_code=204)
def revoke(key_id: str, services: Services = Depends(get_services)) -> None:
    """Revoke a key (idempotent). 404 ``unknown_key``."""
    revoke_key(services.engine, key_id)
