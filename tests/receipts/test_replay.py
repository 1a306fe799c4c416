"""Replay against a tiny versioned store and a deterministic fake retriever (both backends)."""

import json

import pytest
from sqlalchemy import delete, select, update

from foundation.db import WriterLock, write_transaction
from foundation.errors import UnknownReceipt
from foundation.hashing import sha256_ints
from ragbudget_testing.synthetic_receipts import (
    FakeRetriever,
    answer_body,
    make_revision_1,
    make_revisions_2_3,
    rebuild_prompt,
)
from receipts.canonical import canonical_body
from receipts.chain import append_receipt
from receipts.models import ReceiptDocument, ReceiptRow
from receipts.replay import replay
from retrieval.models import Chunk, Revision


@pytest.fixture
def answered(engine):
    """One answer at revision 1 (its receipt id), then revisions 2 and 3 ingested."""
    make_revision_1(engine)
    retriever = FakeRetriever(engine)
    stored = append_receipt(engine, answer_body(retriever))
    make_revisions_2_3(engine)
    return stored.id


def _statuses(report):
    return {c.name: c.status for c in report.checks}


def test_replay_after_the_corpus_moved_on_passes_every_check(engine, answered):
    report = replay(engine, answered, retriever=FakeRetriever(engine), rebuild_prompt=rebuild_prompt)
    assert report.ok, report.render()
    assert _statuses(report) == {"receipt_hash": "ok", "chain_link": "ok", "corpus_root": "ok",
                                 "retrieval": "ok", "embedder": "ok", "stored_chunks": "ok", "prompt": "ok"}


def test_replay_report_names_superseded_cited_documents(engine, answered):
    report = replay(engine, answered, retriever=FakeRetriever(engine), rebuild_prompt=rebuild_prompt)
    changed = {(d["document_id"], d["status"]) for d in report.freshness["documents"] if d["cited"]}
    assert ("doc-a", "superseded") in changed
    assert "superseded by v2 at revision 2" in report.render()


def test_changed_score_fails_retrieval_at_its_rank(engine, answered):
    class Drifting(FakeRetriever):
        def retrieve(self, query, k, revision=None):
            res = super().retrieve(query, k, revision)
            res.hits[1].score = res.hits[1].score + 1e-7
            return res

    check = replay(engine, answered, retriever=Drifting(engine), rebuild_prompt=None).check("retrieval")
    assert check.status == "failed"
    assert "rank 2 (score)" in check.detail


def test_changed_root_hash_fails_corpus_root(engine, answered):
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        s.execute(update(Revision).where(Revision.number == 1).values(root_hash="sha256:" + "9" * 64))
    report = replay(engine, answered, retriever=FakeRetriever(engine), rebuild_prompt=rebuild_prompt)
    assert _statuses(report)["corpus_root"] == "failed" and not report.ok


def test_other_embedder_fails_the_embedder_check(engine, answered):
    report = replay(engine, answered, retriever=FakeRetriever(engine, "sha256:" + "1" * 64),
                    rebuild_prompt=rebuild_prompt)
    assert _statuses(report)["embedder"] == "failed"


def test_different_prompt_fails_with_expected_and_actual_hash(engine, answered):
    report = replay(engine, answered, retriever=FakeRetriever(engine),
                    rebuild_prompt=lambda body, hits: rebuild_prompt(body, hits[:1]))
    check = report.check("prompt")
    assert check.status == "failed"
    assert check.expected["token_ids_hash"] != check.actual["token_ids_hash"]


def test_tampered_stored_chunk_fails_and_skips_the_prompt(engine, answered):
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        s.execute(update(Chunk).where(Chunk.id == 1001).values(text="tampered"))
    report = replay(engine, answered, retriever=None, rebuild_prompt=rebuild_prompt)
    assert _statuses(report)["stored_chunks"] == "failed"
    assert _statuses(report)["prompt"] == "skipped"


def test_missing_hooks_are_skipped_not_failed(engine, answered):
    report = replay(engine, answered, retriever=FakeRetriever(engine), rebuild_prompt=None,
                    want_regenerate=True)
    assert report.ok
    assert _statuses(report)["prompt"] == "skipped" and _statuses(report)["regenerate"] == "skipped"


def test_edited_receipt_fails_its_hash_check(engine, answered):
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        row = s.scalars(select(ReceiptRow).where(ReceiptRow.id == answered)).one()
        b = json.loads(row.body)
        b["question"] = "something else"
        row.body = canonical_body(b).decode()
    report = replay(engine, answered, retriever=None, rebuild_prompt=None)
    assert _statuses(report)["receipt_hash"] == "failed"


def test_missing_previous_receipt_fails_the_link_check(engine, answered):
    retriever = FakeRetriever(engine)
    second = append_receipt(engine, answer_body(retriever, revision=1))
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        s.execute(delete(ReceiptDocument).where(ReceiptDocument.receipt_seq == 1))
        s.execute(delete(ReceiptRow).where(ReceiptRow.seq == 1))
    check = replay(engine, second.id, retriever=None, rebuild_prompt=None).check("chain_link")
    assert check.status == "failed" and "missing" in check.detail


def _regen(ids, env=None):
    return lambda body: {"token_ids": ids, "token_ids_hash": sha256_ints(ids), "text": "x",
                         "environment": env or {}}


def test_identical_regeneration_passes(engine, answered):
    report = replay(engine, answered, retriever=None, rebuild_prompt=None, regenerate=_regen([5, 6, 7]))
    assert report.check("regenerate").status == "ok"


def test_different_regeneration_names_first_token_and_environment(engine, answered):
    env = {"generator.device": "cuda:0", "generator.dtype": "bfloat16", "software.torch": "2.13.0"}
    check = replay(engine, answered, retriever=None, rebuild_prompt=None,
                   regenerate=_regen([5, 9, 7], env)).check("regenerate")
    assert check.status == "failed"
    assert check.actual["first_differing_token"] == 1
    assert [d["field"] for d in check.actual["environment_diff"]] == ["generator.device", "generator.dtype"]


def test_different_regeneration_reports_the_tokens_around_the_first_difference(engine, answered):
    check = replay(engine, answered, retriever=None, rebuild_prompt=None,
                   regenerate=_regen([5, 9, 7, 8])).check("regenerate")
    assert check.actual["context"] == {"start": 0, "position": 1, "recorded": [5, 6, 7],
                                       "regenerated": [5, 9, 7, 8]}


def test_unknown_receipt_raises(engine):
    with pytest.raises(UnknownReceipt):
        replay(engine, "rcpt_missing", retriever=None, rebuild_prompt=None)


def test_report_serialises_and_renders(engine, answered):
    report = replay(engine, answered, retriever=FakeRetriever(engine), rebuild_prompt=rebuild_prompt)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is True and len(data["checks"]) == 7
    assert report.render().startswith(f"replay of {answered} (seq 1): OK")
