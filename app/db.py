"""Opening the configured database and migrating it to head (Alembic)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, text

from app.settings import Settings
from foundation.db import WriterLock, is_sqlite, make_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    """An Alembic config pointing at ``migrations/`` and ``url`` (no alembic.ini needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


@contextmanager
def _sqlite_migration_lock(engine: Engine) -> Iterator[None]:
    """Hold ``<database file>.migrate.lock`` (an OS file lock) for a file database.

    ``BEGIN IMMEDIATE`` already serialises writers, but only within SQLite's busy
    timeout; the file lock makes a second process wait for the first migration
    however long it takes. An in-memory database needs no lock.
    """
    database = engine.url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        yield
        return
    fd = os.open(f"{database}.migrate.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the descriptor closes, or the process dies
        yield
    finally:
        os.close(fd)


def upgrade(engine: Engine) -> None:
    """Apply every pending migration to ``engine``'s database, in one transaction.

    Serialised across processes: on PostgreSQL the transaction first takes
    ``pg_advisory_xact_lock(WriterLock.MIGRATIONS)``, so two processes starting
    on an empty database do not both create the tables (the second waits, then
    finds the schema at head); on SQLite an OS file lock next to the database
    file is held around the upgrade (and the transaction is ``BEGIN IMMEDIATE``).

    On PostgreSQL the DDL is transactional, so a failed migration leaves the
    schema as it was. On SQLite each migration's batch operations run inside
    the same explicit transaction.
    """
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    if is_sqlite(engine):
        with _sqlite_migration_lock(engine), engine.connect() as conn:
            conn.info["write"] = True
            try:
                with conn.begin():
                    cfg.attributes["connection"] = conn
                    command.upgrade(cfg, "head")
            finally:
                conn.info.pop("write", None)
    else:
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": int(WriterLock.MIGRATIONS)})
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")


def open_database(settings: Settings, *, migrate: bool = True) -> Engine:
    """Create the engine for ``settings`` (creating ``data_dir`` for SQLite) and migrate it."""
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    if migrate:
        upgrade(engine)
    return engine
