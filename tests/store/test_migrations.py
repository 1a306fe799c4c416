from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

import app.models  # noqa: F401
import receipts.models  # noqa: F401
import retrieval.models  # noqa: F401
from app.db import upgrade
from foundation.db import Base


def test_empty_database_migrates_to_head_without_drift(engine):
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []
    tables = set(inspect(engine).get_table_names())
    assert set(Base.metadata.tables) <= tables
    assert "alembic_version" in tables


def test_upgrade_is_idempotent(engine):
    upgrade(engine)
    with engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() is not None
