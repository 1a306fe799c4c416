"""Opening the configured database and migrating it to head (Alembic)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine

from app.settings import Settings
from foundation.db import is_sqlite, make_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    """An Alembic config pointing at ``migrations/`` and ``url`` (no alembic.ini needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(engine: Engine) -> None:
    """Apply every pending migration to ``engine``'s database, in one transaction.

    On PostgreSQL the DDL is transactional, so a failed migration leaves the
    schema as it was. On SQLite each migration's batch operations run inside
    the same explicit transaction.
    """
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    if is_sqlite(engine):
        with engine.connect() as conn:
            conn.info["write"] = True
            try:
                with conn.begin():
                    cfg.attributes["connection"] = conn
                    command.upgrade(cfg, "head")
            finally:
                conn.info.pop("write", None)
    else:
        with engine.begin() as conn:
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
