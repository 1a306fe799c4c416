"""Migrations serialised across processes: several processes start on one empty database at once.

Without a lock, two processes both see no ``alembic_version`` table and both
create the schema; on PostgreSQL one dies with a UniqueViolation. ``app.db.upgrade``
takes the ``WriterLock.MIGRATIONS`` advisory lock on PostgreSQL and a file lock on
SQLite. Each PostgreSQL trial uses a fresh database (CREATE DATABASE, dropped after).
"""

from __future__ import annotations

import multiprocessing
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from tests.conftest import PG_BASE
from tests.store.migration_worker import migrate_on_barrier

PROCESSES = 3


def _race(urls: list[str]) -> list[str]:
    """Run PROCESSES workers over ``urls`` (one barrier per url); return every failure text."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=migrate_on_barrier, args=(urls, barrier, results, f"p{n}"))
             for n in range(PROCESSES)]
    for p in procs:
        p.start()
    failures: list[str] = []
    try:
        for _url in urls:
            barrier.wait(timeout=120)
            for _ in range(PROCESSES):
                name, trial, error = results.get(timeout=120)
                if error is not None:
                    failures.append(f"trial {trial} {name}: {error}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    return failures


def _tables(url: str) -> set[str]:
    eng = create_engine(url)
    try:
        return set(inspect(eng).get_table_names())
    finally:
        eng.dispose()


@pytest.mark.postgres
def test_three_processes_migrating_an_empty_postgres_database_at_once_20_times(pg_ok):
    if not pg_ok:
        pytest.skip("PostgreSQL not reachable")
    base = make_url(PG_BASE)
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    names = [f"rb_mig_{uuid.uuid4().hex[:12]}" for _ in range(20)]
    urls = [base.set(database=n).render_as_string(hide_password=False) for n in names]
    try:
        with admin.connect() as c:
            for n in names:
                c.execute(text(f'CREATE DATABASE "{n}"'))
        failures = _race(urls)
        assert failures == [], "\n".join(failures)
        for url in urls:
            assert "alembic_version" in _tables(url) and "receipts" in _tables(url)
    finally:
        with admin.connect() as c:
            for n in names:
                c.execute(text(f'DROP DATABASE IF EXISTS "{n}" WITH (FORCE)'))
        admin.dispose()


def test_three_processes_migrating_an_empty_sqlite_database_at_once(tmp_path: Path):
    urls = [f"sqlite:///{tmp_path / f'db{i}.sqlite'}" for i in range(5)]
    assert _race(urls) == []
    for url in urls:
        assert "alembic_version" in _tables(url)
