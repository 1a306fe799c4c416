"""Console pages over the real services (TestClient): receipts, replay, tuning, corpus."""

from __future__ import annotations

import re

from app.sweep import record_last
from tests.ui.conftest import csrf_of
from tests.ui.world import QUESTIONS


def _receipt_ids(html: str) -> list[str]:
    return re.findall(r'data-receipt="([^"]+)"', html)


def test_list_shows_every_receipt_newest_first(world, operator):
    ids = _receipt_ids(operator.get("/ui/receipts").text)
    assert ids == [world.over_budget, *reversed(world.receipts)]


def test_list_filters_within_and_over_budget(world, operator):
    assert _receipt_ids(operator.get("/ui/receipts?within=no").text) == [world.over_budget]
    assert world.over_budget not in _receipt_ids(operator.get("/ui/receipts?within=yes").text)


def test_list_filters_by_document_used(world, operator):
    everyone = operator.get("/ui/receipts").text
    only = _receipt_ids(operator.get("/ui/receipts", params={"document": world.superseded_document}).text)
    assert world.superseded_receipt in only and set(only) <= set(_receipt_ids(everyone))
    assert _receipt_ids(operator.get("/ui/receipts", params={"document": "no/such.md"}).text) == []


def test_list_filters_by_time_range_and_status(world, operator):
    assert _receipt_ids(operator.get("/ui/receipts?since=2999-01-01T00:00").text) == []
    assert len(_receipt_ids(operator.get("/ui/receipts?until=2999-01-01T00:00&status=ok").text)) == 4
    assert _receipt_ids(operator.get("/ui/receipts?status=failed").text) == []


def test_bad_filter_is_shown_on_the_form_as_422(operator):
    r = operator.get("/ui/receipts?since=yesterday")
    assert r.status_code == 422 and 'id="filter-error"' in r.text and "ISO-8601" in r.text


def test_receipt_page_shows_question_answer_cited_text_and_plan(world, operator):
    from receipts.chain import get_receipt

    body = get_receipt(world.services.engine, world.receipts[1])
    html = operator.get(f"/ui/receipts/{world.receipts[1]}").text
    assert QUESTIONS[1] in html and body["output"]["text"].split(";")[0] in html
    assert html.count('class="chunk"') == body["plan"]["chosen_k"]
    assert f'<tr class="chosen" aria-current="true" data-k="{body["plan"]["chosen_k"]}">' in html
    assert "Measured TTFT" in html and "from prefix cache" in html and body["generator"]["model_id"] in html


def test_superseded_citation_gets_its_badge(world, operator):
    html = operator.get(f"/ui/receipts/{world.superseded_receipt}").text
    assert 'data-freshness="superseded"' in html and "superseded by v2 at revision 2" in html


def test_unknown_receipt_is_a_404_page(operator):
    r = operator.get("/ui/receipts/rcpt_nope")
    assert r.status_code == 404 and 'data-code="unknown_receipt"' in r.text


def test_replay_shows_every_check_ok(world, operator):
    page = operator.get(f"/ui/receipts/{world.receipts[1]}")
    r = operator.post(f"/ui/receipts/{world.receipts[1]}/replay",
                      data={"csrf_token": csrf_of(page.text), "regenerate": "on"})
    statuses = re.findall(r'data-check="([a-z_]+)" data-status="([a-z]+)"', r.text)
    assert r.status_code == 200 and 'data-ok="true"' in r.text
    names = {name for name, _ in statuses}
    assert names >= {"receipt_hash", "chain_link", "retrieval", "prompt", "regenerate"}
    assert all(status == "ok" for _, status in statuses)


def test_replay_difference_shows_the_first_differing_token_in_context(world, operator):
    gen = world.services.generator
    page = operator.get(f"/ui/receipts/{world.receipts[2]}")
    original = gen.reply
    gen.reply = original[:10] + "X" + original[11:]
    try:
        r = operator.post(f"/ui/receipts/{world.receipts[2]}/replay",
                          data={"csrf_token": csrf_of(page.text), "regenerate": "on"})
    finally:
        gen.reply = original
    assert 'data-check="regenerate" data-status="failed"' in r.text
    assert "First differing token: position 10" in r.text
    differing = re.findall(r'<span class="differs" title="token 10 \(id \d+\)">(.)</span>', r.text)
    assert differing == [original[10], "X"]


def test_tuning_page_draws_the_curve_and_marks_the_chosen_k(world, operator):
    r = operator.get("/ui/tuning", params={"question": QUESTIONS[0], "budget_ms": "60000"})
    chosen = re.search(r'data-chosen-k="(\d+)"', r.text)
    assert r.status_code == 200 and chosen
    for gid in ("curve-p50", "curve-p95", "budget-line", "chosen-k"):
        assert f'id="{gid}"' in r.text
    assert f'<tr class="chosen" data-k="{chosen.group(1)}"' in r.text
    assert 'id="profile-fit"' in r.text  # the profile's measured-vs-predicted plot


def test_tuning_overlays_the_last_sweep(world, operator):
    per_k = [{"k": k, "measured_ttft_ms_median": 10.0 + k, "predicted_p50_ms_median": 9.0,
              "predicted_p95_ms_median": 12.0, "prompt_tokens_median": 100, "recall_at_k": None}
             for k in range(4)]
    record_last(world.services.data_dir, {"summary": {"per_k": per_k, "per_budget": []}},
                {"profile_id": "sha256:x", "questions": ["a", "b"]}, {})
    try:
        r = operator.get("/ui/tuning", params={"question": QUESTIONS[0], "budget_ms": "60000"})
    finally:
        (world.services.data_dir / "sweeps" / "last.json").unlink()
    assert 'id="sweep-points"' in r.text and "2 questions" in r.text


def test_tuning_bad_budget_is_shown_as_422(operator):
    r = operator.get("/ui/tuning", params={"question": "q", "budget_ms": "-5"})
    assert r.status_code == 422 and 'id="tuning-error"' in r.text


def test_corpus_lists_revisions_with_root_hashes(world, operator):
    from foundation.db import read_session
    from retrieval.revisions import list_revisions

    html = operator.get("/ui/corpus").text
    with read_session(world.services.engine) as s:
        revs = list_revisions(s)
    assert [int(n) for n in re.findall(r'data-revision="(\d+)"', html)] == [2, 1]
    assert all(r.root_hash in html for r in revs)


def test_revision_page_lists_what_it_changed(world, operator):
    html = operator.get("/ui/corpus/revisions/2").text
    assert world.superseded_document in html and "updated" in html


def test_document_page_diffs_two_versions(world, operator):
    html = operator.get(f"/ui/corpus/documents/{world.superseded_document}").text
    assert "v1 → v2" in html and '<div class="add">+Since this release, archive_library' in html


def test_document_diff_of_a_version_with_itself_is_empty(world, operator):
    html = operator.get(f"/ui/corpus/documents/{world.superseded_document}?a=1&b=1").text
    assert "the same text" in html and 'class="add"' not in html


def test_unknown_document_is_a_404_page(operator):
    r = operator.get("/ui/corpus/documents/no/such.md")
    assert r.status_code == 404 and "unknown_document" in r.text


def test_rest_list_filters_within_budget(world):
    from fastapi.testclient import TestClient

    with TestClient(world.app) as c:
        r = c.get("/v1/receipts?within_budget=false", headers={"X-API-Key": world.keys["operator"]})
    assert [x["id"] for x in r.json()["receipts"]] == [world.over_budget]
    assert r.json()["receipts"][0]["within_budget"] is False


def test_a_failed_receipt_without_plan_or_output_still_renders(world, operator):
    import copy

    from ragbudget_testing.synthetic_receipts import sections
    from receipts.chain import append_receipt
    from receipts.schema import build_receipt_body

    s = copy.deepcopy(sections(status="failed"))
    for name in ("plan", "prompt", "generator", "timings", "output", "scaffold", "embedder", "retrieval"):
        s[name] = None
    s["candidates"] = []
    s["error"] = {"code": "generation_failed", "message": "the model fell over"}
    rid = append_receipt(world.services.engine, build_receipt_body(**s)).id
    try:
        r = operator.get(f"/ui/receipts/{rid}")
        listed = operator.get("/ui/receipts?status=failed").text
    finally:
        from sqlalchemy import delete

        from foundation.db import WriterLock, write_transaction
        from receipts.models import ReceiptRow

        with write_transaction(world.services.engine, WriterLock.RECEIPTS) as tx:
            tx.execute(delete(ReceiptRow).where(ReceiptRow.id == rid))
    assert r.status_code == 200 and "the model fell over" in r.text and "no first token" in r.text
    assert _receipt_ids(listed) == [rid]
