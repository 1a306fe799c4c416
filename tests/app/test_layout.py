"""The prompt layout: the chosen slots in a canonical order, so overlapping retrievals share prefixes;
the same chunks either way, recorded in the receipt, rebuilt token for token by replay."""

from __future__ import annotations

import pytest

from app.prompting.layout import canonical_key, layout_order, shown_as
from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder, PromptChunk
from tests.api.fakes import CharTokenizer


def chunk(doc: str, start: int) -> PromptChunk:
    return PromptChunk(doc, 1, f"text of {doc} at {start}", start_char=start,
                       chunk_hash=f"sha256:{doc}{start}")


A, B, C, D = chunk("a.md", 0), chunk("b.md", 0), chunk("b.md", 900), chunk("c.md", 0)


def test_canonical_order_is_document_then_offset_whatever_the_rank() -> None:
    assert layout_order([C, A, D, B], "canonical") == [2, 4, 1, 3]  # A, B, C, D
    assert layout_order([C, A, D, B], "rank") == [1, 2, 3, 4]
    assert canonical_key(B) < canonical_key(C)
    assert shown_as([2, 4, 1, 3]) == {2: 1, 4: 2, 1: 3, 3: 4}
    with pytest.raises(ValueError):
        layout_order([A], "popular")


def test_overlapping_retrievals_share_a_prefix_only_in_canonical_order() -> None:
    builder = PromptBuilder(CharTokenizer())

    def ids(chunks: list[PromptChunk], layout: str) -> list[int]:
        return builder.build(DEFAULT_SCAFFOLD_TEXT, chunks, "q?", order=layout_order(chunks, layout),
                             layout=layout).ids

    def shared(x: list[int], y: list[int]) -> int:
        return next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))

    one, two = [B, A, C], [A, B, D]  # the same two popular chunks, ranked differently
    scaffold = len(builder.scaffold_ids(DEFAULT_SCAFFOLD_TEXT))
    rank = shared(ids(one, "rank"), ids(two, "rank"))
    canonical = shared(ids(one, "canonical"), ids(two, "canonical"))
    assert rank < scaffold + len("[1] (doc a.md v1)")  # they part inside the first label
    ab = builder.build(DEFAULT_SCAFFOLD_TEXT, [A, B], "q?")
    assert canonical >= ab.prompt_tokens - ab.question_tokens - ab.framing_tokens  # A and B shared


def test_candidate_prompts_in_a_layout_are_what_the_builder_lays_out_for_each_k() -> None:
    builder = PromptBuilder(CharTokenizer())
    chunks = [C, A, D, B]
    full = builder.candidates(DEFAULT_SCAFFOLD_TEXT, chunks, "q?", layout="canonical")
    for k in range(len(chunks) + 1):
        p = builder.build(DEFAULT_SCAFFOLD_TEXT, chunks[:k], "q?",
                          order=layout_order(chunks[:k], "canonical"), layout="canonical")
        assert full.ids_for(k) == p.ids and full.prompt_tokens_for(k) == p.prompt_tokens
    steps = full.planned_chunk_tokens()
    assert len(steps) == len(chunks) and all(s > 0 for s in steps)
    assert sum(steps) == full.prompt_tokens_for(4) - full.prompt_tokens_for(0)
    # the same slots are shown, only their order (and so their numbers) changes
    p = builder.build(DEFAULT_SCAFFOLD_TEXT, chunks, "q?", order=layout_order(chunks, "canonical"))
    assert p.text.index("[1] (doc a.md") < p.text.index("[2] (doc b.md") < p.text.index("[4] (doc c.md")
    assert all(c.text in p.text for c in chunks)
    assert p.prompt_tokens == builder.build(DEFAULT_SCAFFOLD_TEXT, chunks, "q?").prompt_tokens
