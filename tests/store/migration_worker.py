"""A separate process that migrates databases to head, released by a shared barrier.

Used by ``tests/store/test_migration_race.py``: several of these wait at one
``multiprocessing.Barrier`` with the test, then all call :func:`app.db.upgrade` on the
same empty database at once, the way two API replicas (or serve + ingest) start.
"""

from __future__ import annotations

import traceback
from typing import Any


def migrate_on_barrier(urls: list[str], barrier: Any, results: Any, name: str) -> None:
    """For each url: wait at ``barrier``, upgrade the database, put ``(name, i, error or None)``."""
    from app.db import upgrade
    from foundation.db import make_engine

    for i, url in enumerate(urls):
        barrier.wait(timeout=120)
        error = None
        engine = make_engine(url)
        try:
            upgrade(engine)
        except Exception:  # reported to the test, which fails with it
            error = traceback.format_exc(limit=3)
        finally:
            engine.dispose()
        results.put((name, i, error))
