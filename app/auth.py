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
tell which ids exist. Revocation takes effect on the next request. On PostgreSQL the
key row is read on every request (one indexed read). On a SQLite file the key table is
held in memory and read again whenever any connection, in this process or another
(``ragbudget keys revoke``), has committed since the last look: one ``PRAGMA
data_version`` per request (https://sqlite.org/pragma.html#pragma_data_version), which
changes exactly when another connection commits, so a check is a pragma and a dict
lookup. The whole read, SQLAlchemy's connection checkout and statement execution, was
most of a key check (0.69 ms of it on a 2-core AVX2 EPYC, docs/benchmarks.md).

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
import sqlite3
import threading
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

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


class KeyRow(NamedTuple):
    """What a key check reads of one ``api_keys`` row."""

    key_hash: str
    salt: str
    name: str
    role: str
    revoked_at: str | None


class SqliteKeyTable:
    """Every ``api_keys`` row of one SQLite database file, in memory (thread-safe).

    :meth:`get` first asks its own read-only-in-practice connection for ``PRAGMA
    data_version``; when it changed since the table was read (any other connection, of any
    process, committed: a key created, revoked or re-hashed, or any other write), the table
    is read again before the lookup. The version is read before the rows, so a commit
    between the two only causes one more read next time, never a stale answer.

    Raises:
        sqlite3.Error: the file cannot be opened (callers fall back to a read per request).
    """

    def __init__(self, path: str) -> None:
        self._conn = sqlite3.connect(path, check_same_thread=False, timeout=60.0)
        self._lock = threading.Lock()
        self._version: int | None = None
        self._rows: dict[str, KeyRow] = {}
        self.reads = 0  # times the table was read (for tests and diagnostics)

    def get(self, key_id: str) -> KeyRow | None:
        """The row of ``key_id`` as committed now, or ``None`` when there is none."""
        with self._lock:
            version = int(self._conn.execute("PRAGMA data_version").fetchone()[0])
            if version != self._version:
                rows = self._conn.execute(
                    "SELECT id, key_hash, salt, name, role, revoked_at FROM api_keys").fetchall()
                self._rows = {r[0]: KeyRow(*r[1:]) for r in rows}
                self._version = version
                self.reads += 1
            return self._rows.get(key_id)


_TABLES: weakref.WeakKeyDictionary[Engine, SqliteKeyTable | None] = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def key_table(engine: Engine) -> SqliteKeyTable | None:
    """The in-memory key table of ``engine``'s database when it is a SQLite file (made on first
    use, one per engine), else ``None`` (PostgreSQL, in-memory SQLite, or a file that cannot
    be opened: the key row is then read per request)."""
    with _TABLES_LOCK:
        if engine in _TABLES:
            return _TABLES[engine]
        table: SqliteKeyTable | None = None
        database = engine.url.database
        if engine.dialect.name == "sqlite" and database and database != ":memory:" \
                and not database.startswith("file:"):
            try:
                table = SqliteKeyTable(database)
            except sqlite3.Error:
                table = None
        _TABLES[engine] = table
        return table


def _key_row(engine: Engine, key_id: str) -> Any:
    """The key row of ``key_id`` as committed now (a :class:`KeyRow`-shaped row) or ``None``."""
    table = key_table(engine)
    if table is not None:
        try:
            return table.get(key_id)
        except sqlite3.Error:
            pass  # e.g. the table is locked for longer than the timeout: read it the usual way
    with engine.connect() as conn:
        return conn.execute(select(ApiKey.key_hash, ApiKey.salt, ApiKey.name, ApiKey.role,
                                   ApiKey.revoked_at).where(ApiKey.id == key_id)).first()


def authenticate(engine: Engine, presented: str | None) -> Principal:
    """Resolve a presented key to its principal (one key row as committed now, one HMAC-SHA256,
    one constant-time compare; the row from :class:`SqliteKeyTable` on a SQLite file, else one
    indexed read).

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
    row = _key_row(engine, key_id)
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
