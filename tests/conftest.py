"""Shared fixtures: settings on a tmp data dir, databases on SQLite and PostgreSQL.

PostgreSQL tests use a fresh schema per test on the server at 127.0.0.1:5432
(database ``test``, trust auth). When ``RAGBUDGET_REQUIRE_POSTGRES=1`` (set by
``.ci/run``) an unreachable server is an error, never a skip.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

from app.db import open_database
from app.settings import Settings, get_settings

PG_BASE = os.environ.get("RAGBUDGET_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
# The edge-case inputs (cases/) and the real corpora (corpora/) live beside the checkout in
# ../shared; RAGBUDGET_SHARED_DIR points elsewhere (a clone that does not sit beside it).
SHARED = Path(os.environ.get("RAGBUDGET_SHARED_DIR")
              or Path(__file__).resolve().parent.parent.parent / "shared").expanduser()
CASES = SHARED / "cases"
CORPORA = SHARED / "corpora"
if not CASES.is_dir():
    raise pytest.UsageError(
        f"the test inputs are missing: no {CASES} (the suite reads ../shared/cases beside the "
        "checkout; set RAGBUDGET_SHARED_DIR to the folder holding cases/ and corpora/)")
# One export of the default (onnx, int8) embedder for the whole suite: every data directory
# that builds the real embedder reuses the graphs here instead of exporting its own.
# Exports are written atomically under a lock, so parallel processes share them safely.
os.environ.setdefault("RAGBUDGET_EMBEDDER_EXPORT_DIR",
                      str(Path(__file__).resolve().parent.parent / "ragbudget-data" / "models"))


def _pg_available() -> bool:
    try:
        eng = create_engine(PG_BASE)
        with eng.connect() as c:
            c.execute(text("SELECT 1"))
        eng.dispose()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def pg_ok() -> bool:
    ok = _pg_available()
    if not ok and os.environ.get("RAGBUDGET_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"PostgreSQL is required but unreachable at {PG_BASE}")
    return ok


@pytest.fixture
def pg_url(pg_ok: bool) -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh, empty schema (dropped afterwards)."""
    if not pg_ok:
        pytest.skip("PostgreSQL not reachable")
    schema = "t_" + uuid.uuid4().hex[:12]
    admin = create_engine(PG_BASE, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{PG_BASE}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The database URL under test: a SQLite file in tmp_path, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ragbudget.db'}"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def settings(tmp_path: Path, db_url: str) -> Settings:
    """Settings with the data dir in tmp_path and the database under test."""
    return get_settings(data_dir=tmp_path / "data", database_url=db_url, auth_enabled=False)


@pytest.fixture
def engine(settings: Settings) -> Iterator[Engine]:
    """An engine on the database under test, migrated to head."""
    eng = open_database(settings)
    yield eng
    eng.dispose()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``ragbudget *argv`` in process; ``(exit code, stdout, stderr)``."""
    from app.cli.main import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err
