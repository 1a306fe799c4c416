"""Queries are normalised as stored text is, so an identifier copied with invisible characters matches."""

from __future__ import annotations

from retrieval.retriever import Retriever
from tests.retrieval.corpus import FixtureCorpus

DOC = {"bgw": "Set BGWORKER_BACKEND_DATABASE_CONNECTION before calling BackgroundWorkerInitializeConnection.",
       "pump": "The circulation pump is painted red."}


def test_a_query_with_zero_width_soft_hyphen_and_nbsp_ranks_exactly_as_its_clean_form(
        corpus: FixtureCorpus, retriever: Retriever) -> None:
    corpus.commit(DOC)
    clean = retriever.retrieve("BGWORKER_BACKEND_DATABASE_CONNECTION flag", 2)
    dirty = retriever.retrieve("BGWORKER_BACKEND_\u200bDATABASE_\u00adCONNECTION\u00a0flag", 2)
    assert [(h.chunk_id, h.score) for h in dirty.hits] == [(h.chunk_id, h.score) for h in clean.hits]
    assert dirty.hits[0].document_id == "bgw"
