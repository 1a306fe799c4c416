"""Replay with the real version-pinned retriever (fake embedder) after the corpus moved on."""

import pytest

from ragbudget_testing.synthetic_receipts import fake_prompt, rebuild_prompt, sections
from receipts.chain import append_receipt
from receipts.replay import replay
from receipts.schema import build_receipt_body
from retrieval.retriever import Retriever
from tests.retrieval.corpus import FixtureCorpus
from tests.retrieval.fakes import HashingEmbedder

QUESTION = "how is wal archiving configured with archive_command"
V1 = {
    "wal.html": "WAL archiving is configured with archive_command.\n\nSet archive_mode to on first.",
    "vacuum.html": "Autovacuum removes dead tuples.\n\nIt runs in the background.",
    "dump.html": "pg_dump writes a logical backup of one database.",
}


def _body_from(result, chosen_k):
    """A receipt body filled the way the answer pipeline fills it from a RetrievalResult."""
    s = sections(question=QUESTION, revision=result.revision, root_hash=result.root_hash, chosen_k=chosen_k,
                 candidates=[{"rank": h.rank, "score": h.score, "chunk_id": h.chunk_id,
                              "document_id": h.document_id, "version": h.version,
                              "chunk_hash": h.chunk_hash} for h in result.hits])
    s["embedder"] = {"id": result.embedder_id, "identity": result.embedder}
    s["retrieval"] = {"k_candidates": result.k, "index": result.index,
                      "query_truncated": result.query_truncated, "query": QUESTION}
    token_ids_hash, n = fake_prompt(QUESTION, result.hits[:chosen_k])
    s["prompt"].update(token_ids_hash=token_ids_hash, prompt_tokens=n)
    return build_receipt_body(**s)


@pytest.fixture
def setup(engine, tmp_path):
    embedder = HashingEmbedder()
    corpus = FixtureCorpus(engine, embedder)
    corpus.commit(V1)
    retriever = Retriever(engine, embedder, tmp_path / "index")
    result = retriever.retrieve(QUESTION, 5)
    stored = append_receipt(engine, _body_from(result, chosen_k=2))
    corpus.commit({"wal.html": "WAL archiving may use archive_library instead.\n\nSet archive_mode to on.",
                   "dump.html": None})
    return stored.id, result, Retriever(engine, embedder, tmp_path / "index2")


def test_replay_with_the_real_retriever_is_identical_after_updates_and_deletes(engine, setup):
    receipt_id, _, retriever = setup
    report = replay(engine, receipt_id, retriever=retriever, rebuild_prompt=rebuild_prompt)
    assert report.ok, report.render()
    assert report.check("retrieval").status == "ok" and report.check("prompt").status == "ok"


def test_replay_reports_the_cited_page_the_update_changed(engine, setup):
    receipt_id, result, retriever = setup
    report = replay(engine, receipt_id, retriever=retriever, rebuild_prompt=rebuild_prompt)
    docs = {d["document_id"]: d for d in report.freshness["documents"]}
    assert result.hits[0].document_id == "wal.html"
    assert (docs["wal.html"]["cited"], docs["wal.html"]["status"], docs["wal.html"]["superseded_by"]) == (
        True, "superseded", 2)
    if "dump.html" in docs:
        assert docs["dump.html"]["status"] == "deleted"
