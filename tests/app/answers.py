"""Build typed :class:`app.answering.types.Answer` objects for unit tests from a few fields."""

from __future__ import annotations

from typing import Any

from app.answering.types import Answer


def make_answer(**fields: Any) -> Answer:
    """An ``ok`` answer with neutral values; ``fields`` override (nested dicts are merged)."""
    base: dict[str, Any] = {
        "status": "ok", "error": None, "text": "", "question": "q", "ttft_budget_ms": 1000.0,
        "within_budget": True, "revision": 1, "chosen_k": 0, "binding": "budget",
        "predicted": {"ttft_p50_ms": None, "ttft_p95_ms": None, "prefill_p50_ms": None,
                      "overhead_ms": 0.0, "profile_id": "sha256:" + "0" * 64,
                      "profile_source": "fitted"},
        "timings": {"queue_ms": None, "ttft_ms": None, "tpot_ms": None, "retrieval_ms": None,
                    "overhead_ms": None, "total_ms": None},
        "tokens": {"prompt": 0, "cached": 0, "computed": 0, "output": 0},
        "citations": [], "receipt_id": None, "finish_reason": "stop",
    }
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return Answer.model_validate(base)
