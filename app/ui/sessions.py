"""Console sessions: an API key is exchanged once for a session cookie.

The key is checked with :func:`app.auth.authenticate` at sign-in and never kept:
the session remembers only the key's id and role, and every later request
re-reads the key row (:func:`app.auth.active_principal`), so revoking the key
ends its sessions at once. The cookie carries a random 256-bit token; the store
keeps only its SHA-256, so a dump of the store cannot be replayed as a cookie.

Sessions live in this process's memory (the server is one process with one
model, see docs/architecture.md): a restart signs everyone out, which is the
safe direction. A session ends on sign-out, after ``ui_session_idle_s`` without
a request, or ``ui_session_max_s`` after sign-in, whichever comes first.

CSRF: every session has its own random token (the synchronizer-token pattern,
OWASP CSRF Prevention Cheat Sheet) that each state-changing form carries in a
hidden field; the cookie is also ``SameSite=Strict``. The sign-in form, which
has no session yet, uses a double-submit cookie (a random token in both a
``SameSite=Strict`` cookie and the form).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.auth import Principal

SESSION_COOKIE = "rb_console"
LOGIN_CSRF_COOKIE = "rb_console_login"
COOKIE_PATH = "/ui"
MAX_SESSIONS = 10_000  # a bound on memory; the oldest sessions go first beyond it


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tokens_equal(a: str | None, b: str | None) -> bool:
    """Constant-time comparison of two tokens; False when either is missing or empty."""
    if not a or not b:
        return False
    return hmac.compare_digest(a.encode(), b.encode())


@dataclass
class ConsoleSession:
    """One signed-in browser. Times are ``time.monotonic()`` seconds."""

    key_id: str
    name: str
    role: str
    csrf_token: str
    created_s: float
    last_seen_s: float

    @property
    def principal(self) -> Principal:
        """The API-key principal this session signed in with (its key id, name and role)."""
        return Principal(self.key_id, self.name, self.role)


class SessionStore:
    """Thread-safe in-memory sessions keyed by the SHA-256 of their cookie token.

    ``idle_s``: seconds without a request after which a session ends; ``max_s``:
    seconds after creation after which it ends regardless. ``clock`` returns
    monotonic seconds (injectable for tests).
    """

    def __init__(self, idle_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = float(idle_s)
        self.max_s = float(max_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, ConsoleSession] = {}

    def create(self, principal: Principal) -> tuple[str, ConsoleSession]:
        """Start a session for ``principal``; return ``(cookie token, session)``."""
        token = secrets.token_urlsafe(32)
        now = self._clock()
        session = ConsoleSession(key_id=principal.id, name=principal.name, role=principal.role,
                                 csrf_token=secrets.token_urlsafe(32), created_s=now, last_seen_s=now)
        with self._lock:
            self._sweep(now)
            while len(self._sessions) >= MAX_SESSIONS:
                oldest = min(self._sessions, key=lambda k: self._sessions[k].created_s)
                del self._sessions[oldest]
            self._sessions[_digest(token)] = session
        return token, session

    def get(self, token: str | None) -> ConsoleSession | None:
        """The live session for a cookie token (its idle clock restarts), or None when absent,
        unknown or expired (an expired one is removed)."""
        if not token:
            return None
        key = _digest(token)
        now = self._clock()
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                return None
            if self._expired(session, now):
                del self._sessions[key]
                return None
            session.last_seen_s = now
            return session

    def end(self, token: str | None) -> bool:
        """End the session of ``token``; True when there was one."""
        if not token:
            return False
        with self._lock:
            return self._sessions.pop(_digest(token), None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def _expired(self, session: ConsoleSession, now: float) -> bool:
        return now - session.last_seen_s > self.idle_s or now - session.created_s > self.max_s

    def _sweep(self, now: float) -> None:
        for key in [k for k, s in self._sessions.items() if self._expired(s, now)]:
            del self._sessions[key]
