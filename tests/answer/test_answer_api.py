"""``POST /v1/answer`` (both modes) and ``ragbudget ask`` give real answers over real PostgreSQL pages.

Every answer writes a receipt that replays: the chain verifies and the prompt
rebuilt from the stored chunks is token-identical.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.answer.conftest import BUDGET_MS, CANDIDATES, PAGES, QUESTION, receipt_body, sse_events

pytestmark = pytest.mark.slow

MAX_NEW = 8


def _body(**extra: Any) -> dict[str, Any]:
    return {"question": QUESTION, "ttft_budget_ms": BUDGET_MS, "max_new_tokens": MAX_NEW, **extra}


@pytest.fixture(scope="module")
def plain_answer(live_server: Any) -> dict[str, Any]:
    r = httpx.post(f"{live_server.base_url}/v1/answer", json=_body(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def streamed(live_server: Any) -> list[tuple[str, str]]:
    with httpx.stream("POST", f"{live_server.base_url}/v1/answer", json=_body(stream=True),
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(r.iter_lines()))


def test_non_stream_answer_cites_retrieved_pages_with_measured_timings(plain_answer):
    a = plain_answer
    assert a["status"] == "ok" and a["error"] is None
    assert a["text"].strip()
    assert a["chosen_k"] == CANDIDATES  # the 60 s budget fits every candidate
    assert len(a["citations"]) == a["chosen_k"]
    assert {c["document_id"] for c in a["citations"]} <= set(PAGES)
    assert "backup-dump.html" in {c["document_id"] for c in a["citations"]}
    t, tok = a["timings"], a["tokens"]
    assert 0 < t["queue_ms"] <= t["ttft_ms"] <= t["total_ms"]
    assert t["retrieval_ms"] > 0 and t["tpot_ms"] > 0
    assert 1 <= tok["output"] <= MAX_NEW
    assert tok["prompt"] == tok["cached"] + tok["computed"]
    assert tok["cached"] > 0  # the scaffold was warmed at start-up
    assert a["predicted"]["ttft_p95_ms"] >= a["predicted"]["ttft_p50_ms"] > 0
    assert a["within_budget"] is (t["ttft_ms"] <= a["ttft_budget_ms"])


def test_non_stream_receipt_records_the_answer_and_replays(plain_answer, answer_services):
    from app.answering.receipt_wiring import replay_receipt
    from receipts.verify import verify_chain

    body = receipt_body(answer_services, plain_answer["receipt_id"])
    assert body["status"] == "ok"
    assert body["output"]["text"] == plain_answer["text"]
    assert answer_services.tokenizer.decode(body["output"]["token_ids"]) == plain_answer["text"]
    assert body["output"]["output_tokens"] == len(body["output"]["token_ids"])
    assert body["prompt"]["cached_tokens"] == plain_answer["tokens"]["cached"]
    report = replay_receipt(answer_services, plain_answer["receipt_id"])
    assert report.ok, report.render()
    assert {c.name: c.status for c in report.checks}["prompt"] == "ok"
    assert verify_chain(answer_services.engine).ok


def test_stream_sends_token_events_then_final_summary_then_done(streamed):
    names = [name for name, _ in streamed]
    assert streamed[-1] == ("message", "[DONE]")
    assert names[-2] == "final"
    assert names[0] == "token" and set(names[:-2]) == {"token"}
    final = json.loads(streamed[-2][1])
    tokens = "".join(json.loads(data)["text"] for name, data in streamed if name == "token")
    assert tokens.strip() and tokens == final["text"]
    assert final["status"] == "ok" and final["receipt_id"].startswith("rcpt_")
    assert final["timings"]["ttft_ms"] > 0 and final["tokens"]["output"] >= len(names) - 2


def test_stream_and_non_stream_give_the_same_greedy_answer(streamed, plain_answer):
    final = json.loads(streamed[-2][1])
    assert final["text"] == plain_answer["text"]
    assert [c["chunk_id"] for c in final["citations"]] == [c["chunk_id"] for c in plain_answer["citations"]]


def test_stream_receipt_exists_and_verifies(streamed, answer_services):
    from receipts.chain import receipt_hash

    final = json.loads(streamed[-2][1])
    body = receipt_body(answer_services, final["receipt_id"])
    assert body["hash"] == receipt_hash(body)
    assert body["status"] == "ok" and body["output"]["text"] == final["text"]
    assert body["timings"]["ttft_ms"] == pytest.approx(final["timings"]["ttft_ms"])


def test_ask_command_streams_a_real_answer_and_prints_the_summary(answer_services, capsys):
    from app.cli.main import build_parser

    args = build_parser().parse_args(["ask", QUESTION, "--budget-ms", str(BUDGET_MS),
                                      "--max-new-tokens", str(MAX_NEW)])
    assert args.func(args, answer_services) == 0
    out = capsys.readouterr().out
    answer, _, summary = out.partition("\n\n")
    assert answer.strip()
    assert f"k={CANDIDATES}" in summary and "TTFT predicted p50" in summary and "TPOT" in summary
    assert "backup-dump.html" in summary and "receipt: rcpt_" in summary
    assert "OVER BUDGET" not in summary  # the 60 s budget is kept


def test_ask_summary_flags_a_budget_miss_and_not_a_kept_budget():
    from app.answering.types import Answer
    from app.cli.answer_cmds import render_summary
    from tests.app.answers import make_answer

    def summary(ttft_ms: float) -> Answer:
        return make_answer(
            status="ok", chosen_k=1, binding="budget", ttft_budget_ms=800.0,
            within_budget=ttft_ms <= 800.0,
            predicted={"ttft_p50_ms": 500.0, "ttft_p95_ms": 600.0, "profile_source": "fitted"},
            timings={"ttft_ms": ttft_ms, "queue_ms": 0.0, "retrieval_ms": 20.0, "tpot_ms": 40.0},
            tokens={"prompt": 200, "cached": 80, "computed": 120, "output": 8},
            citations=[{"rank": 1, "score": 0.5, "chunk_id": "1", "document_id": "a.html", "version": 1,
                        "chunk_hash": "sha256:" + "0" * 64}],
            receipt_id="rcpt_x")

    assert "OVER BUDGET by 3112 ms" in render_summary(summary(3912.0))
    assert "OVER BUDGET" not in render_summary(summary(800.0))


def test_metrics_count_ok_answers_and_prompt_tokens(plain_answer, live_server):
    text = httpx.get(f"{live_server.base_url}/metrics", timeout=10).text
    ok = [ln for ln in text.splitlines() if ln.startswith('ragbudget_answers_total{status="ok"}')]
    assert ok and float(ok[0].split()[-1]) >= 1
    assert "ragbudget_ttft_ms_bucket" in text and "ragbudget_tpot_ms_count" in text
