"""Process entry points for the concurrency tests (importable by spawned children)."""

from __future__ import annotations

from foundation.db import make_engine
from ragbudget_testing.synthetic_receipts import body
from receipts.chain import append_receipt


def append_many(url: str, tag: str, n: int) -> list[str]:
    """Open a fresh engine on ``url`` and append ``n`` receipts; return their ids."""
    engine = make_engine(url)
    try:
        return [append_receipt(engine, body(question=f"{tag}-{i}")).id for i in range(n)]
    finally:
        engine.dispose()
