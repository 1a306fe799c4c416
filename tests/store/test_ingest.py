"""Store semantics, each pinned on SQLite and PostgreSQL (the ``engine`` fixture)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from sqlalchemy import func, select

from foundation.db import read_session
from foundation.errors import UnknownDocument, UnknownRevision, UnknownVersion
from foundation.hashing import normalize_text
from retrieval.chunking import chunk_id
from retrieval.models import Chunk, Document, DocumentVersion, Embedding, Revision
from retrieval.store import (
    IngestItem,
    get_document,
    get_revision,
    get_version,
    latest_revision,
    list_revisions,
    list_versions,
    root_hash,
    state_at,
    verify_store,
)
from tests.conftest import CASES


def rows(engine, model):  # type: ignore[no-untyped-def]
    with read_session(engine) as s:
        return int(s.scalar(select(func.count()).select_from(model)))


def head(engine) -> int:  # type: ignore[no-untyped-def]
    with read_session(engine) as s:
        return latest_revision(s)


def test_empty_store_is_at_revision_zero_with_the_empty_root(engine):
    with read_session(engine) as s:
        assert latest_revision(s) == 0
        assert state_at(s, 0) == []
    assert root_hash([]) == "sha256:" + hashlib.sha256(b"[]").hexdigest()


def test_first_batch_is_revision_one_with_counts_and_root(engine, ingest):
    report = ingest([IngestItem("a.txt", text="Alpha."), IngestItem("b.txt", text="Beta.")], note="first")
    assert report.revision == 1
    with read_session(engine) as s:
        rev = get_revision(s, 1)
        assert (rev.added, rev.updated, rev.deleted, rev.unchanged, rev.live_documents) == (2, 0, 0, 0, 2)
        assert rev.note == "first" and rev.created_at.endswith("+00:00")
        live = state_at(s, 1)
        assert rev.root_hash == root_hash([(v.document_id, v.content_hash) for v in live])


def test_the_caller_id_is_kept_verbatim(engine, ingest):
    ingest([IngestItem("guides/setup/Install Notes.md", text="Install it.", kind="md")])
    with read_session(engine) as s:
        assert get_document(s, "guides/setup/Install Notes.md").current.text == "Install it."


def test_content_hash_is_sha256_of_the_normalised_utf8_text(engine, ingest):
    ingest([IngestItem("n", text="cafe\u0301\r\nline two\r")])
    with read_session(engine) as s:
        v = get_version(s, "n", 1)
    assert v.text == "caf\u00e9\nline two\n"
    assert v.content_hash == "sha256:" + hashlib.sha256(v.text.encode("utf-8")).hexdigest()


def test_same_content_after_normalisation_is_unchanged(engine, ingest):
    ingest([IngestItem("n", text="cafe\u0301\r\nok")])
    report = ingest([IngestItem("n", text="caf\u00e9\nok")])
    assert report.results[0].status == "unchanged"
    assert report.revision is None


def test_identical_content_again_creates_no_version_and_no_revision(engine, ingest):
    ingest([IngestItem("a", text="Same text.", metadata={"v": 1})])
    before = (rows(engine, DocumentVersion), rows(engine, Chunk), rows(engine, Revision))
    report = ingest([IngestItem("a", text="Same text.", metadata={"v": 2})])
    assert [r.status for r in report.results] == ["unchanged"]
    assert report.revision is None and report.results[0].version == 1
    assert (rows(engine, DocumentVersion), rows(engine, Chunk), rows(engine, Revision)) == before


def test_changed_content_adds_the_next_version_and_keeps_the_old_one(engine, ingest):
    ingest([IngestItem("a", text="First text.")])
    report = ingest([IngestItem("a", text="Second text.")])
    assert report.results[0].status == "updated" and report.results[0].version == 2
    with read_session(engine) as s:
        assert get_version(s, "a", 1).text == "First text."
        assert get_version(s, "a", 1).live_until_revision == 2
        assert get_document(s, "a").current.version == 2
        assert [v.version for v in list_versions(s, "a")] == [1, 2]


def test_delete_adds_a_tombstone_and_removes_the_document_from_later_revisions(engine, ingest):
    ingest([IngestItem("a", text="Keep me."), IngestItem("b", text="Delete me.")])
    report = ingest([], delete_ids=["b"])
    assert report.results[0].status == "deleted" and report.revision == 2
    with read_session(engine) as s:
        assert [v.document_id for v in state_at(s, 2)] == ["a"]
        assert [v.document_id for v in state_at(s, 1)] == ["a", "b"]
        versions = list_versions(s, "b")
        assert [(v.version, v.is_tombstone) for v in versions] == [(1, False), (2, True)]
        assert get_version(s, "b", 1).text == "Delete me."
        doc = get_document(s, "b")
        assert doc.is_deleted and doc.current is None


def test_changes_at_lists_the_versions_and_tombstones_a_revision_made(engine, ingest):
    from retrieval.revisions import changes_at

    ingest([IngestItem("a", text="one"), IngestItem("b", text="two"), IngestItem("c", text="three")])
    ingest([IngestItem("a", text="one, edited"), IngestItem("c", text="three")], delete_ids=["b"])
    with read_session(engine) as s:
        made = [(v.document_id, v.version, v.is_tombstone) for v in changes_at(s, 2)]
        assert made == [("a", 2, False), ("b", 2, True)]
        assert [v.document_id for v in changes_at(s, 1, limit=2, offset=1)] == ["b", "c"]
        assert all(v.text is None for v in changes_at(s, 1))


def test_deleting_an_unknown_or_deleted_document_is_rejected_and_writes_nothing(engine, ingest):
    ingest([IngestItem("a", text="x")])
    ingest([], delete_ids=["a"])
    report = ingest([], delete_ids=["a", "never"])
    assert [(r.status, r.code) for r in report.results] == [("rejected", "unknown_document")] * 2
    assert report.revision is None and head(engine) == 2


def test_a_deleted_document_can_be_added_again_as_the_next_version(engine, ingest):
    ingest([IngestItem("a", text="one")])
    ingest([], delete_ids=["a"])
    report = ingest([IngestItem("a", text="one")])
    assert (report.results[0].status, report.results[0].version) == ("added", 3)
    with read_session(engine) as s:
        assert [v.document_id for v in state_at(s, 3)] == ["a"]
        assert verify_store(s) == []


def test_state_at_every_past_revision_recomputes_its_stored_root(engine, ingest):
    ingest([IngestItem(f"d{i}", text=f"Document {i}.") for i in range(5)])
    ingest([IngestItem("d1", text="Document one, edited."), IngestItem("d9", text="New.")])
    ingest([], delete_ids=["d2", "d3"])
    ingest([IngestItem("d2", text="Back again.")])
    with read_session(engine) as s:
        revisions = list_revisions(s)
        assert [r.number for r in revisions] == [1, 2, 3, 4]
        assert [r.live_documents for r in revisions] == [5, 6, 4, 5]
        for r in revisions:
            live = state_at(s, r.number)
            assert root_hash([(v.document_id, v.content_hash) for v in live]) == r.root_hash
            assert [v.document_id for v in live] == sorted(v.document_id for v in live)
        assert verify_store(s) == []


def test_unknown_revision_document_and_version_raise_not_found(engine, ingest):
    ingest([IngestItem("a", text="x")])
    with read_session(engine) as s:
        with pytest.raises(UnknownRevision):
            state_at(s, 2)
        with pytest.raises(UnknownRevision):
            get_revision(s, 0)
        with pytest.raises(UnknownDocument):
            get_document(s, "nope")
        with pytest.raises(UnknownVersion):
            get_version(s, "a", 2)


@pytest.mark.parametrize("name", ["empty.txt", "whitespace_only.txt", "invisible_only.txt"])
def test_no_content_cases_are_rejected_with_a_reason_and_store_nothing(engine, ingest, name):
    report = ingest([IngestItem(name, raw=(CASES / name).read_bytes())])
    assert report.results[0].status == "rejected"
    assert report.results[0].code == "empty_content" and report.results[0].reason
    assert report.revision is None
    assert (rows(engine, Document), rows(engine, DocumentVersion), rows(engine, Chunk)) == (0, 0, 0)


def test_bad_items_are_rejected_individually_and_the_rest_commits(engine, ingest):
    report = ingest([
        IngestItem("good", text="Fine."),
        IngestItem("utf", raw=b"\xc3\x28 bad"),
        IngestItem("bin", raw=b"GIF89a\x00\x01"),
        IngestItem("big", text="x" * 2000),
        IngestItem("type", text="x", kind="pdf"),
        IngestItem(" spaced", text="x"),
        IngestItem("good", text="Duplicate id."),
    ], max_document_bytes=1000)
    assert [(r.status, r.code) for r in report.results] == [
        ("added", None), ("rejected", "invalid_encoding"), ("rejected", "invalid_encoding"),
        ("rejected", "too_large"), ("rejected", "unsupported_type"), ("rejected", "invalid_document_id"),
        ("rejected", "invalid_input")]
    assert report.revision == 1 and rows(engine, Document) == 1


def test_stored_chunks_slice_the_stored_text_with_gapless_ordinals_and_derived_ids(engine, ingest):
    for name in ["blank_pages_and_gap.txt", "multibyte_mix.txt", "unbroken_long_content.txt",
                 "special_tokens_in_text.md"]:
        kind = "md" if name.endswith(".md") else "txt"
        assert ingest([IngestItem(name, raw=(CASES / name).read_bytes(), kind=kind)]).counts["added"] == 1
    with read_session(engine) as s:
        for version in s.scalars(select(DocumentVersion)):
            chunks = list(s.scalars(select(Chunk).where(Chunk.version_id == version.id)
                                    .order_by(Chunk.ordinal)))
            assert [c.ordinal for c in chunks] == list(range(len(chunks)))
            for c in chunks:
                assert version.text[c.start_char:c.end_char] == c.text and c.text.strip()
                assert c.id == chunk_id(version.document_id, version.version, c.ordinal)
                assert c.n_tokens <= 64


def test_multibyte_text_is_stored_nfc_normalised(engine, ingest):
    raw = (CASES / "multibyte_mix.txt").read_bytes()
    ingest([IngestItem("mb", raw=raw)])
    with read_session(engine) as s:
        text = get_version(s, "mb", 1).text
    assert text == normalize_text(raw.decode("utf-8")) and "e\u0301" not in text


def test_editing_a_document_leaves_the_old_chunks_only_at_the_old_revision(engine, ingest):
    ingest([IngestItem("doc", raw=(CASES / "doc_v1.txt").read_bytes())])
    ingest([IngestItem("doc", raw=(CASES / "doc_v2_shorter_changed.txt").read_bytes())])
    with read_session(engine) as s:
        (v1,), (v2,) = state_at(s, 1), state_at(s, 2)
        assert (v1.version, v2.version) == (1, 2)
        live_now = set(s.scalars(select(Chunk.version_id).where(Chunk.version_id == v2.version_id)))
        assert live_now == {v2.version_id}
        assert "30 days" in " ".join(s.scalars(select(Chunk.text).where(Chunk.version_id == v1.version_id)))
        assert "30 days" not in " ".join(s.scalars(select(Chunk.text)
                                                   .where(Chunk.version_id == v2.version_id)))


def test_a_failure_inside_the_batch_rolls_everything_back(engine, ingest, monkeypatch):
    ingest([IngestItem("a", text="Alpha.")])
    import retrieval.commit as commit

    def boom() -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(commit, "_pause_for_tests", boom)
    with pytest.raises(RuntimeError):
        ingest([IngestItem("a", text="Alpha two."), IngestItem("b", text="Beta.")])
    assert head(engine) == 1
    assert (rows(engine, Document), rows(engine, DocumentVersion), rows(engine, Chunk)) == (1, 1, 1)
    with read_session(engine) as s:
        assert verify_store(s) == []


class FakeEmbedder:
    """The ``retrieval.embedding.Embedder`` surface ingest needs: deterministic 4-d vectors."""

    embedder_id = "sha256:" + "e" * 64
    identity = {"name": "fake", "dim": 4}
    dim = 4
    max_seq_length = 256

    def __init__(self) -> None:
        self.calls = 0

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        self.calls += len(texts)
        return np.array([[len(t), t.count(" "), 1.0, 0.0] for t in texts], dtype=np.float32)

    def count_wordpieces(self, text: str) -> int:
        return len(text.split()) + 2


def test_embeddings_of_new_chunks_commit_with_the_batch_and_are_never_recomputed(engine, ingest):
    emb = FakeEmbedder()
    ingest([IngestItem("a", text="One sentence. Two sentence."), IngestItem("b", text="Other.")],
           embedder=emb, embed_token_count=None)
    with read_session(engine) as s:
        hashes = set(s.scalars(select(Chunk.chunk_hash)))
        stored = set(s.scalars(select(Embedding.chunk_hash).where(Embedding.embedder_id == emb.embedder_id)))
    assert hashes == stored and emb.calls == len(hashes)
    ingest([IngestItem("c", text="Other.")], embedder=emb, embed_token_count=None)  # same chunk text as b
    assert emb.calls == len(hashes) and rows(engine, Embedding) == len(hashes)


def test_a_change_committed_between_prepare_and_commit_is_diffed_against_the_new_head(engine, ingest):
    ingest([IngestItem("a", text="Original text.")])

    def meanwhile(done: int, total: int) -> None:  # runs after preparing, before the write transaction
        ingest([IngestItem("a", text="Someone else's edit.")])

    report = ingest([IngestItem("a", text="Original text.")], progress=meanwhile)
    assert (report.results[0].status, report.results[0].version, report.revision) == ("updated", 3, 3)
    with read_session(engine) as s:
        assert get_version(s, "a", 3).n_chunks == 1
        assert verify_store(s) == []


def test_markdown_front_matter_is_stored_as_metadata_and_no_chunk_holds_it_or_a_comment(engine, ingest):
    from tests.store.test_extract import MD

    report = ingest([IngestItem("pump.md", raw=MD.encode(), kind="md"),
                     IngestItem("api.md", text=MD, kind="md")])
    assert report.counts["added"] == 2
    with read_session(engine) as s:
        for doc in ("pump.md", "api.md"):
            v = get_version(s, doc, 1)
            assert v.front_matter is not None and v.front_matter["deploy_token"] == "tok-FRONTMATTER-7781"
            assert v.front_matter["updated"] == "2024-03-01" and v.source["kind"] == "md"
            assert "FRONTMATTER" not in v.text and "COMMENT" not in v.text
        texts = list(s.scalars(select(Chunk.text)))
    assert texts and not any("FRONTMATTER" in t or "COMMENT" in t or "hunter2" in t for t in texts)


def test_a_utf16_file_is_ingested_and_an_undecodable_one_is_rejected_alone(engine, ingest):
    text = "Die Pumpe wird halbjährlich geprüft."
    report = ingest([IngestItem("de.txt", raw=b"\xff\xfe" + text.encode("utf-16-le")),
                     IngestItem("bad.txt", raw=b"\xfe\xff" + text.encode("utf-16-be")[:-1]),
                     IngestItem("latin.html", raw=b"<html><body>caf\xe9</body></html>", kind="html")])
    assert report.revision == 1 and report.counts["added"] == 1 and report.counts["rejected"] == 2
    reasons = {r.document_id: (r.code, r.reason) for r in report.rejected}
    assert reasons["bad.txt"][0] == "invalid_encoding" and "UTF-16-BE" in reasons["bad.txt"][1]
    assert reasons["latin.html"][0] == "invalid_encoding" and "UTF-8" in reasons["latin.html"][1]
    with read_session(engine) as s:
        assert get_version(s, "de.txt", 1).text == text
