"""Identical chunk texts share one prompt slot that cites every source; the receipt records each
candidate's slot and replay lays the same prompt out again (a receipt from before slots too)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.prompting.prompt import PromptChunk
from app.prompting.slots import in_first_slots, prompt_slots, slot_numbers
from foundation.errors import InvalidInput
from receipts.schema import candidate_slots, cited_candidates, validate_body

REPO = Path(__file__).resolve().parents[2]
PUMP = ("The circulation pump in building 4 is inspected every six months; the inspection log "
        "records the bearing temperature and the seal condition.")
OTHERS = {
    "valve.txt": "The pressure relief valve opens at 6 bar and is replaced every ten years.",
    "filter.txt": "The intake filter is cleaned monthly and the pump is stopped while it is out.",
    "tank.txt": "The storage tank holds 40 cubic metres and is drained once a year for inspection.",
}
COPIES = ["pump.txt", "copy/pump.txt", "mirror/pump.txt"]
QUESTION = "How often is the circulation pump in building 4 inspected?"


def _hit(rank: int, doc: str, text: str) -> dict[str, Any]:
    from foundation.hashing import sha256_text

    return {"rank": rank, "document_id": doc, "version": 1, "text": text, "chunk_hash": sha256_text(text)}


def test_identical_texts_share_the_slot_their_best_ranked_copy_opened():
    assert slot_numbers(["a", "b", "a", "c", "b", "a"]) == [1, 2, 1, 3, 2, 1]
    hits = [_hit(1, "pump.txt", PUMP), _hit(2, "valve.txt", OTHERS["valve.txt"]),
            _hit(3, "copy/pump.txt", PUMP), _hit(4, "tank.txt", OTHERS["tank.txt"])]
    slots = prompt_slots(hits)
    assert [(s.document_id, s.also) for s in slots] == [("pump.txt", (("copy/pump.txt", 1),)),
                                                        ("valve.txt", ()), ("tank.txt", ())]
    assert [h["rank"] for h in in_first_slots(hits, 1)] == [1, 3]


def test_a_slot_label_names_every_copy():
    from app.prompting.prompt import PromptBuilder

    chunk = PromptChunk("pump.txt", 2, PUMP, also=(("copy/pump.txt", 1), ("mirror/pump.txt", 3)))
    assert PromptBuilder.chunk_segment(1, chunk).splitlines()[0] == (
        "[1] (doc pump.txt v2; also doc copy/pump.txt v1, doc mirror/pump.txt v3)")
    assert PromptBuilder.chunk_segment(2, PromptChunk("valve.txt", 1, "x")) == "\n\n[2] (doc valve.txt v1)\nx"


def _body(slots: list[int] | None, hashes: list[str], chosen_k: int) -> dict[str, Any]:
    cands = [{"rank": i + 1, "chunk_hash": h, "document_id": f"d{i}", "version": 1}
             for i, h in enumerate(hashes)]
    for c, s in zip(cands, slots or [], strict=False):
        c["slot"] = s
    return {"candidates": cands, "plan": {"chosen_k": chosen_k}}


def test_cited_candidates_are_those_in_the_first_k_slots_and_by_position_without_slots():
    hashes = ["h1", "h2", "h1", "h3"]
    assert [c["rank"] for c in cited_candidates(_body([1, 2, 1, 3], hashes, 1))] == [1, 3]
    assert [c["rank"] for c in cited_candidates(_body(None, hashes, 1))] == [1]
    assert candidate_slots(_body(None, hashes, 1)) == [1, 2, 3, 4]


@pytest.mark.parametrize(("slots", "why"), [
    ([1, 3, 1, 2], "the next is 2"),
    ([1, 2, 2, 3], "different chunk text"),
    ([1, 2, 1], "every candidate records its slot"),
])
def test_recorded_slots_must_open_in_rank_order_and_hold_one_text(slots, why):
    from receipts.schema import _check_slots

    body = _body(slots, ["h1", "h2", "h1", "h3"], 2)
    with pytest.raises(InvalidInput, match=why):
        _check_slots(body["candidates"])
    with pytest.raises(InvalidInput):
        validate_body({**body, "question": "q", "status": "ok"})


# --- the real pipeline, on SQLite and PostgreSQL ------------------------------------------------

@pytest.fixture
def services(tmp_path: Path, db_url: str) -> Iterator[Any]:
    """Real models over three copies of one text and three other texts (K = 5)."""
    from app.ingest import IngestService
    from app.services import Services
    from app.settings import get_settings
    from generation.assets import ensure_packaged_generator
    from retrieval.store import IngestItem

    settings = get_settings(data_dir=tmp_path / "data", database_url=db_url, auth_enabled=False,
                            generator_path=str(ensure_packaged_generator(REPO / "ragbudget-data")),
                            generator_device="cpu", torch_threads=1, default_ttft_budget_ms=60_000.0,
                            retrieval_candidates=5, chunk_tokens=64, chunk_overlap_tokens=8)
    s = Services(settings)
    items = [IngestItem(d, text=PUMP) for d in COPIES] + [IngestItem(d, text=t) for d, t in OTHERS.items()]
    assert IngestService(s).ingest(items).report.counts["added"] == 6
    yield s
    s.close()


def _answer(services: Any) -> tuple[Any, Any, dict[str, Any]]:
    from app.answering.pipeline import AnswerPipeline
    from app.answering.state import AnswerRequest
    from receipts.chain import get_receipt

    pipeline = AnswerPipeline(services)
    req = AnswerRequest(question=QUESTION, ttft_budget_ms=60_000.0, max_new_tokens=1)
    prepared = pipeline.prepare(req)
    answer = pipeline.answer(req)
    assert answer.status == "ok" and answer.receipt_status == "written"
    return prepared, answer, get_receipt(services.engine, str(answer.receipt_id))


@pytest.mark.slow
def test_copies_take_one_prompt_slot_and_the_freed_slots_go_to_the_next_distinct_chunks(services):
    from app.answering.receipt_wiring import replay_receipt

    prepared, answer, body = _answer(services)
    hits = prepared.retrieval.hits
    assert {h.document_id for h in hits[:3]} == set(COPIES)
    assert len(prepared.full_prompt.chunk_token_counts) == 3  # 5 candidates, 3 distinct texts
    assert answer.chosen_k == 3 and prepared.prompt.text.count(PUMP) == 1
    first = hits[0].document_id
    others = ", ".join(f"doc {h.document_id} v1" for h in hits[1:3])
    assert f"[1] (doc {first} v1; also {others})" in prepared.prompt.text
    assert "[3] (doc " in prepared.prompt.text
    assert [c["slot"] for c in body["candidates"]] == [1, 1, 1, 2, 3]
    assert [(c.rank, c.slot) for c in answer.citations] == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 3)]
    report = replay_receipt(services, str(answer.receipt_id))
    assert report.ok and report.check("prompt").status == "ok", report.render()


@pytest.mark.slow
def test_a_receipt_from_before_slots_replays_with_one_slot_per_candidate(services):
    from app.answering.pipeline import AnswerPipeline
    from app.answering.receipt_wiring import replay_receipt
    from receipts.chain import append_receipt
    from receipts.spool import content_of

    prepared, _answer_, body = _answer(services)
    scaffold, builder = AnswerPipeline(services).scaffold_and_builder()
    # the prompt such a receipt recorded: the first 3 candidates, each its own place (all copies)
    old = builder.build(scaffold.text, [PromptChunk(h.document_id, h.version, h.text)
                                        for h in prepared.retrieval.hits[:3]], QUESTION)
    assert old.text.count(PUMP) == 3
    before = copy.deepcopy(content_of(body))
    for c in before["candidates"]:
        del c["slot"]
    before["plan"]["chosen_k"] = 3
    before["prompt"].pop("layout", None)  # it predates prompt layouts too: rank order
    before["prompt"].update(token_ids_hash=old.prompt_hash, prompt_tokens=old.prompt_tokens)
    stored = append_receipt(services.engine, before)
    report = replay_receipt(services, str(stored.id))
    assert report.ok and report.check("prompt").status == "ok", report.render()
    assert report.check("stored_chunks").expected == 3
