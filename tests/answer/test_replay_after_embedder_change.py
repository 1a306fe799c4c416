"""A receipt replays after the configured embedder changes (e.g. the default backend moving
from torch to onnx int8): replay rebuilds the receipt's own embedder from its identity."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.answering.receipt_wiring import replay_receipt, retriever_for_receipt
from app.services import Services
from tests.answer.conftest import BUDGET_MS, QUESTION

pytestmark = pytest.mark.slow


def test_a_receipt_replays_under_another_configured_embedder(live_server: Any, answer_services: Any) -> None:
    r = httpx.post(f"{live_server.base_url}/v1/answer",
                   json={"question": QUESTION, "ttft_budget_ms": BUDGET_MS, "max_new_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    receipt_id = r.json()["receipt_id"]
    settings = answer_services.settings.model_copy(update={"embedder_backend": "torch"})
    other = Services(settings)
    try:
        assert other.embedder.embedder_id != answer_services.embedder.embedder_id
        rebuilt = retriever_for_receipt(other, receipt_id)
        assert rebuilt.embedder.embedder_id == answer_services.embedder.embedder_id
        report = replay_receipt(other, receipt_id)
        checks = {c.name: c for c in report.checks}
        assert checks["retrieval"].ok and checks["embedder"].ok, [c.detail for c in report.checks]
    finally:
        other.close()
