"""API keys and roles.

Keys are ``rb_<id>_<secret>`` with a 64-bit hex id and a random 256-bit secret
(``secrets.token_urlsafe(32)``), shown once, at creation. Only
``hmac-sha256:<hex>``, HMAC-SHA256 (RFC 2104) of the secret keyed by a random
per-key salt, is stored, and a presented key is checked with one HMAC-SHA256 and
a constant-time compare (``hmac.compare_digest``): microseconds, so
authentication costs nothing against a TTFT budget. A slow, salted password hash
(scrypt, bcrypt) exists to make guessing a *low-entropy* password expensive; a
256-bit random secret cannot be guessed, so a fast hash is as strong here (the
practice of GitHub tokens and of OWASP's guidance on API keys), and a stolen
table still yields no key (that would take a SHA-256 preimage).

Same cost for every rejection: an unknown id is compared against a dummy digest,
a revoked key is compared before it is refused, so the response time does not
tell which ids exist. Revocation is read from the database on every request
(it takes effect on the next one).

Keys created before this scheme are stored as salted scrypt hashes (RFC 7914,
n=2**14, r=8, p=1, no prefix). They keep working: the first successful use
verifies with scrypt once and re-hashes the secret to ``hmac-sha256:`` in place.

Roles are ordered: ``copilot`` < ``operator`` < ``admin``; a role may do
everything the roles below it may.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import Engine, select, update

from app.models import ApiKey
from foundation.bounds import check_text
from foundation.db import WriterLock, read_session, write_transaction
from foundation.errors import Forbidden, InvalidInput, NotFound, Unauthenticated
from foundation.provenance import utc_now_iso

ROLES = ("copilot", "operator", "admin")
_RANK = {r: i for i, r in enumerate(ROLES)}
SCRYPT = {"n": 2**14, "r": 8, "p": 1, "dklen": 32}  # legacy keys only
FAST_PREFIX = "hmac-sha256:"
MAX_SECRET_CHARS = 128  # token_urlsafe(32) is 43 characters; longer is malformed, never hashed
_KEY_ID = re.compile(r"[0-9a-f]{16}")
MAX_KEY_ID_BYTES = 64  # ids are 16 hex digits; the column holds at most 64 characters
MAX_KEY_NAME_BYTES = 512  # the name column holds 128 characters (4 bytes each at most)


def _scrypt_secret(secret: str, salt: str) -> str:
    """The legacy stored form: scrypt of the secret with a per-key salt, hex."""
    return hashlib.scrypt(secret.encode(), salt=bytes.fromhex(salt), **SCRYPT).hex()


def _hash_secret(secret: str, salt: str) -> str:
    """The stored form of a secret: ``hmac-sha256:<hex>``, keyed by the key's hex ``salt``."""
    return FAST_PREFIX + hmac.new(bytes.fromhex(salt), secret.encode(), hashlib.sha256).hexdigest()


# Compared against when the presented id is unknown, so that path costs what a known id costs.
_DUMMY_SALT = "00" * 16
_DUMMY_HASH = _hash_secret("ragbudget: no key has this id", _DUMMY_SALT)


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
    check_text(name, "name", max_bytes=MAX_KEY_NAME_BYTES)
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
        InvalidInput: an id no backend can hold (NUL, not Unicode, over 64 bytes).
        NotFound: no such key id.
    """
    check_text(key_id, "key_id", max_bytes=MAX_KEY_ID_BYTES)
    with write_transaction(engine, WriterLock.KEYS) as s:
        row = s.get(ApiKey, key_id)
        if row is None:
            raise NotFound(f"no API key {key_id!r}", code="unknown_key")
        if row.revoked_at is None:
            row.revoked_at = utc_now_iso()


def authenticate(engine: Engine, presented: str | None) -> Principal:
    """Resolve a presented key to its principal (one indexed read, one SHA-256, one compare).

    Raises:
        Unauthenticated: missing, malformed, unknown or revoked key (one message for the
            last three, so the answer does not tell which).
    """
    if not presented:
        raise Unauthenticated("missing API key (Authorization: Bearer <key> or X-API-Key)")
    parts = presented.split("_", 2)
    if (len(parts) != 3 or parts[0] != "rb" or not _KEY_ID.fullmatch(parts[1])
            or not 0 < len(parts[2]) <= MAX_SECRET_CHARS):
        raise Unauthenticated("malformed API key")
    _, key_id, secret = parts
    with engine.connect() as conn:
        row = conn.execute(select(ApiKey.key_hash, ApiKey.salt, ApiKey.name, ApiKey.role,
                                  ApiKey.revoked_at).where(ApiKey.id == key_id)).first()
    if row is not None and not row.key_hash.startswith(FAST_PREFIX):
        ok = _verify_legacy(engine, key_id, secret, row.salt, row.key_hash)
    else:
        salt, stored = (row.salt, row.key_hash) if row is not None else (_DUMMY_SALT, _DUMMY_HASH)
        ok = hmac.compare_digest(stored, _hash_secret(secret, salt))
    if row is None or not ok or row.revoked_at is not None:
        raise Unauthenticated("unknown or revoked API key")
    return Principal(key_id, row.name, row.role)


def _verify_legacy(engine: Engine, key_id: str, secret: str, salt: str, stored: str) -> bool:
    """Check a key stored as scrypt; on success re-hash it as HMAC-SHA256 in place (once)."""
    if not hmac.compare_digest(stored, _scrypt_secret(secret, salt)):
        return False
    new_salt = secrets.token_hex(16)
    with write_transaction(engine, WriterLock.KEYS) as s:
        s.execute(update(ApiKey).where(ApiKey.id == key_id, ApiKey.key_hash == stored)
                  .values(key_hash=_hash_secret(secret, new_salt), salt=new_salt))
    return True


def active_principal(engine: Engine, key_id: str) -> Principal:
    """The principal of the key ``key_id`` if it is still active (no secret check).

    For callers that already proved the full key once (a console session made by
    :func:`authenticate`) and must stop when the key is revoked later.

    Raises:
        Unauthenticated: no such key, or it was revoked.
    """
    try:
        check_text(key_id, "key_id", max_bytes=MAX_KEY_ID_BYTES)
    except InvalidInput as exc:
        raise Unauthenticated("unknown or revoked API key") from exc
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
