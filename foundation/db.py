"""The database ground every room stands on: engine, declarative base, sessions, write transactions.

SQLite (embedded default) is opened in WAL mode with a busy timeout and foreign
keys on. Write transactions (:func:`write_transaction`) are serialised:
``BEGIN IMMEDIATE`` on SQLite, a transaction-scoped advisory lock on
PostgreSQL, so two processes ingesting or appending receipts at once queue
instead of failing with "database is locked" or forking a chain.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum
from typing import Any

from sqlalchemy import Engine, MetaData, create_engine, event, text
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}



class WriterLock(IntEnum):
    """One advisory-lock key per kind of writer (PostgreSQL ``pg_advisory_xact_lock``).

    Writers of one kind queue behind each other; writers of different kinds run
    concurrently (they touch disjoint tables). On SQLite every write transaction
    is ``BEGIN IMMEDIATE``, so all writers serialise whatever their kind.
    The values are arbitrary fixed int64s ("rag" + a small number); they must
    never change, or an old and a new process would not exclude each other.
    """

    CORPUS = 0x7261670001      # ingest batches: versions, chunks, embeddings, revisions
    RECEIPTS = 0x7261670002    # the receipt chain (one head)
    PROFILES = 0x7261670003    # latency profiles
    KEYS = 0x7261670004        # API keys
    SCAFFOLDS = 0x7261670005   # prompt scaffolds
    MIGRATIONS = 0x7261670006  # schema migrations (app.db.upgrade)
    JOURNAL = 0x7261670007     # started answers' journal rows (receipts.journal)


class Base(DeclarativeBase):
    """Declarative base shared by every room's tables."""

    metadata = MetaData(naming_convention=NAMING)


def make_engine(url: str, *, busy_timeout_ms: int = 60_000, **kwargs: Any) -> Engine:
    """Create an engine for ``url`` with the pragmas and begin behaviour ragbudget relies on.

    SQLite: WAL, ``busy_timeout``, ``foreign_keys=ON``, ``synchronous=NORMAL``;
    transactions begin explicitly (deferred by default, ``IMMEDIATE`` when the
    connection is opened via :func:`write_transaction`).
    """
    if url.startswith("sqlite"):
        engine = create_engine(
            url, connect_args={"timeout": busy_timeout_ms / 1000, "check_same_thread": False},
            **kwargs,
        )

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            mode = "IMMEDIATE" if conn.info.get("write") else "DEFERRED"
            conn.exec_driver_sql(f"BEGIN {mode}")

        return engine
    return create_engine(url, pool_pre_ping=True, **kwargs)


def is_sqlite(engine: Engine) -> bool:
    """True for the embedded SQLite backend."""
    return engine.dialect.name == "sqlite"


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit."""
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def read_session(engine: Engine) -> Iterator[Session]:
    """A session for reads; closed (its transaction rolled back) at the end.

    Objects loaded in it stay readable afterwards (detached, not expired).
    """
    with Session(engine, expire_on_commit=False) as session:
        yield session


@contextmanager
def write_transaction(engine: Engine, lock: WriterLock) -> Iterator[Session]:
    """One serialised write transaction: all of it commits, or none of it.

    SQLite: the connection begins with ``BEGIN IMMEDIATE`` (one writer at a
    time; others wait up to the busy timeout). PostgreSQL:
    ``pg_advisory_xact_lock(lock)`` (one key per writer kind, :class:`WriterLock`)
    is taken first, released at commit or rollback. Any exception rolls everything back and propagates.
    """
    conn = engine.connect()
    try:
        if is_sqlite(engine):
            conn.info["write"] = True
        with Session(bind=conn, expire_on_commit=False) as session:
            session.begin()
            if not is_sqlite(engine):
                session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": int(lock)})
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise
    finally:
        conn.info.pop("write", None)
        conn.close()
