"""API keys and roles.

Keys are ``rb_<id>_<secret>``; only a salted scrypt hash of the secret is stored
(RFC 7914 parameters n=2**14, r=8, p=1, the OWASP-recommended minimum), and the
key is shown once, at creation. Roles are ordered: ``copilot`` < ``operator`` <
``admin``; a role may do everything the roles below it may.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy import Engine, select

from app.models import ApiKey
from foundation.db import WriterLock, read_session, write_transaction
from foundation.errors import Forbidden, InvalidInput, NotFound, Unauthenticated
from foundation.provenance import utc_now_iso

ROLES = ("copilot", "operator", "admin")
_RANK = {r: i for i, r in enumerate(ROLES)}
SCRYPT = {"n": 2**14, "r": 8, "p": 1, "dklen": 32}


def _hash_secret(secret: str, salt: str) -> str:
    return hashlib.scrypt(secret.encode(), salt=bytes.fromhex(salt), **SCRYPT).hex()


@dataclass(frozen=True)
class Principal:
    """Who is calling: key id, name and role (``id == "anonymous"`` when auth is disabled)."""

    id: str
    name: str
    role: str

    def allows(self, role: str) -> bool:
        """True when this principal's role is ``role`` or above."""
        return _RANK[self.role] >= _RANK[role]


ANONYMOUS_ADMIN = Principal(id="anonymous", name="auth disabled", role="admin")


def create_key(engine: Engine, role: str, name: str = "") -> tuple[Principal, str]:
    """Create a key; return its principal and the full key (shown once, never stored).

    Raises:
        InvalidInput: unknown role.
    """
    if role not in _RANK:
        raise InvalidInput(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_hex(16)
    with write_transaction(engine, WriterLock.KEYS) as s:
        s.add(ApiKey(id=key_id, name=name or role, role=role, salt=salt,
                     key_hash=_hash_secret(secret, salt), created_at=utc_now_iso()))
    return Principal(key_id, name or role, role), f"rb_{key_id}_{secret}"


def list_keys(engine: Engine) -> list[dict[str, object]]:
    """All keys (never their secrets): id, name, role, created_at, revoked_at."""
    with read_session(engine) as s:
        rows = s.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)).all()
        return [{"id": r.id, "name": r.name, "role": r.role, "created_at": r.created_at,
                 "revoked_at": r.revoked_at} for r in rows]


def active_key_count(engine: Engine) -> int:
    """Number of keys not revoked."""
    with read_session(engine) as s:
        return len(s.scalars(select(ApiKey.id).where(ApiKey.revoked_at.is_(None))).all())


def revoke_key(engine: Engine, key_id: str) -> None:
    """Revoke a key (idempotent).

    Raises:
        NotFound: no such key id.
    """
    with write_transaction(engine, WriterLock.KEYS) as s:
        row = s.get(ApiKey, key_id)
        if row is None:
            raise NotFound(f"no API key {key_id!r}", code="unknown_key")
        if row.revoked_at is None:
            row.revoked_at = utc_now_iso()


def authenticate(engine: Engine, presented: str | None) -> Principal:
    """Resolve a presented key to its principal.

    Raises:
        Unauthenticated: missing, malformed, unknown or revoked key.
    """
    if not presented:
        raise Unauthenticated("missing API key (Authorization: Bearer <key> or X-API-Key)")
    parts = presented.split("_", 2)
    if len(parts) != 3 or parts[0] != "rb":
        raise Unauthenticated("malformed API key")
    _, key_id, secret = parts
    with read_session(engine) as s:
        row = s.get(ApiKey, key_id)
        if row is None or row.revoked_at is not None:
            raise Unauthenticated("unknown or revoked API key")
        if not hmac.compare_digest(row.key_hash, _hash_secret(secret, row.salt)):
            raise Unauthenticated("unknown or revoked API key")
        return Principal(row.id, row.name, row.role)


def active_principal(engine: Engine, key_id: str) -> Principal:
    """The principal of the key ``key_id`` if it is still active (no secret check).

    For callers that already proved the full key once (a console session made by
    :func:`authenticate`) and must stop when the key is revoked later.

    Raises:
        Unauthenticated: no such key, or it was revoked.
    """
    with read_session(engine) as s:
        row = s.get(ApiKey, key_id)
        if row is None or row.revoked_at is not None:
            raise Unauthenticated("unknown or revoked API key")
        return Principal(row.id, row.name, row.role)


def require(principal: Principal, role: str) -> None:
    """Raise :class:`Forbidden` unless ``principal`` holds ``role`` or above."""
    if not principal.allows(role):
        raise Forbidden(f"this action needs role {role!r}; key {principal.id} has {principal.role!r}",
                        required_role=role, role=principal.role)
