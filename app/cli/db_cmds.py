"""``ragbudget db upgrade``: apply pending migrations."""

from __future__ import annotations

import argparse

from app.cli.common import add_json_flag, emit


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``db upgrade`` to the top-level subparsers ``sub``."""
    db = sub.add_parser("db", help="database maintenance")
    dbsub = db.add_subparsers(dest="db_command", metavar="ACTION")
    dbsub.required = True
    up = dbsub.add_parser("upgrade", help="apply pending Alembic migrations")
    add_json_flag(up)
    up.set_defaults(func=cmd_upgrade)


def cmd_upgrade(args: argparse.Namespace, services) -> int:  # type: ignore[no-untyped-def]
    """``ragbudget db upgrade``: open the database (which applies pending Alembic migrations)
    and print the URL (password hidden) and the migration it is now at. Returns 0."""
    from alembic.migration import MigrationContext

    engine = services.engine  # opening migrates to head
    with engine.connect() as conn:
        head = MigrationContext.configure(conn).get_current_revision()
    emit(args, {"database": engine.url.render_as_string(hide_password=True), "revision": head},
         lambda p: f"database at migration {p['revision']}: {p['database']}")
    return 0
