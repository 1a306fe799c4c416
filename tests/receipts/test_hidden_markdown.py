"""What Markdown hides stays hidden: neither its front matter nor an HTML comment in it (a
password, a token) reaches a chunk, a prompt, a receipt or a receipt page (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from tests.store.test_extract import MD

REPO = Path(__file__).resolve().parents[2]
SECRETS = ("tok-FRONTMATTER-7781", "hunter2-COMMENT", "ssh-COMMENT-9931")

pytestmark = pytest.mark.slow


@pytest.fixture
def services(tmp_path: Path, db_url: str) -> Iterator[Any]:
    """Real models over the Markdown page (ingested from bytes, as a folder ingest reads it)."""
    from app.ingest import IngestService
    from app.services import Services
    from app.settings import get_settings
    from generation.assets import ensure_packaged_generator
    from retrieval.store import IngestItem

    settings = get_settings(data_dir=tmp_path / "data", database_url=db_url, auth_enabled=False,
                            generator_path=str(ensure_packaged_generator(REPO / "ragbudget-data")),
                            generator_device="cpu", torch_threads=1, default_ttft_budget_ms=60_000.0,
                            retrieval_candidates=4, chunk_tokens=64, chunk_overlap_tokens=8)
    s = Services(settings)
    items = [IngestItem("pump.md", raw=MD.encode(), kind="md"),
             IngestItem("valve.txt", text="The relief valve opens at 6 bar.")]
    assert IngestService(s).ingest(items).report.counts["added"] == 2
    yield s
    s.close()


def test_front_matter_and_comments_reach_no_chunk_prompt_receipt_or_receipt_page(services):
    from app.answering.pipeline import AnswerPipeline
    from app.answering.state import AnswerRequest
    from app.ui.receipt_view import receipt_view
    from foundation.db import read_session
    from receipts.chain import get_receipt
    from retrieval.models import Chunk

    pipeline = AnswerPipeline(services)
    req = AnswerRequest(question="What is the admin password and the deploy token of the pump?",
                        ttft_budget_ms=60_000.0, max_new_tokens=1)
    prepared = pipeline.prepare(req)
    answer = pipeline.answer(req)
    assert answer.status == "ok" and answer.chosen_k >= 1
    assert "pump.md" in {c.document_id for c in answer.citations}
    with read_session(services.engine) as s:
        chunks = "\n".join(s.scalars(select(Chunk.text)))
    body = json.dumps(get_receipt(services.engine, str(answer.receipt_id)))
    view = receipt_view(services.engine, str(answer.receipt_id))
    page = "\n".join(c.text or "" for c in view.cited + view.others)
    assert "The pump is inspected every six months." in page
    for secret in SECRETS:
        assert secret not in chunks and secret not in prepared.prompt.text
        assert secret not in body and secret not in page
