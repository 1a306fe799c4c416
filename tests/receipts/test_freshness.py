from ragbudget_testing.synthetic_receipts import body, candidate, make_revision_1, make_revisions_2_3
from receipts.freshness import freshness, render_freshness


def _body():
    # cited: doc-a v1, doc-b v1; candidate only: doc-c v1
    return body(candidates=[candidate(1, "doc-a", 1, chunk_id=1001), candidate(2, "doc-b", 1, chunk_id=1002),
                            candidate(3, "doc-c", 1, chunk_id=1004)], chosen_k=2)


def _by_doc(fresh):
    return {d["document_id"]: d for d in fresh["documents"]}


def test_everything_current_before_the_corpus_moves(engine):
    make_revision_1(engine)
    fresh = freshness(engine, _body())
    assert not fresh["changed"] and fresh["latest_revision"] == 1
    assert {d["status"] for d in fresh["documents"]} == {"current"}


def test_updated_document_is_reported_superseded_with_version_and_revision(engine):
    make_revision_1(engine)
    make_revisions_2_3(engine)
    doc_a = _by_doc(freshness(engine, _body()))["doc-a"]
    assert (doc_a["status"], doc_a["superseded_by"], doc_a["changed_at_revision"]) == ("superseded", 2, 2)
    assert doc_a["current_version"] == 2


def test_deleted_document_is_reported_deleted_at_its_revision(engine):
    make_revision_1(engine)
    make_revisions_2_3(engine)
    doc_b = _by_doc(freshness(engine, _body()))["doc-b"]
    assert (doc_b["status"], doc_b["changed_at_revision"], doc_b["current_version"]) == ("deleted", 3, None)


def test_counts_cover_cited_versions_only(engine):
    make_revision_1(engine)
    make_revisions_2_3(engine)
    fresh = freshness(engine, _body())
    assert fresh["changed"] and fresh["latest_revision"] == 3
    assert fresh["counts"] == {"current": 0, "superseded": 1, "deleted": 1, "unknown": 0}
    assert _by_doc(fresh)["doc-c"]["cited"] is False


def test_version_missing_from_the_store_is_unknown(engine):
    make_revision_1(engine)
    fresh = freshness(engine, body(candidates=[candidate(1, "doc-x", 9)], chosen_k=1))
    assert fresh["documents"][0]["status"] == "unknown" and fresh["changed"]


def test_rendering_names_changed_documents(engine):
    make_revision_1(engine)
    make_revisions_2_3(engine)
    text = render_freshness(freshness(engine, _body()))
    assert "doc-a v1: superseded by v2 at revision 2" in text
    assert "doc-b v1: deleted at revision 3" in text
