from __future__ import annotations

import hashlib

import pytest
import regex

from foundation.errors import InvalidConfig
from foundation.hashing import normalize_text, sha256_text
from retrieval.chunking import ChunkerConfig, chunk_id, chunk_text, chunker_id, has_visible
from tests.conftest import CASES

CASE_FILES = ["blank_pages_and_gap.txt", "multibyte_mix.txt", "unbroken_long_content.txt",
              "special_tokens_in_text.md", "doc_v1.txt", "doc_v2_shorter_changed.txt",
              "chat_turn_injection_doc.txt"]


def case_text(name: str) -> str:
    return normalize_text((CASES / name).read_bytes().decode("utf-8-sig"))


def grapheme_boundaries(text: str) -> set[int]:
    return {0} | {m.end() for m in regex.finditer(r"\X", text)}


def uncovered_visible(text: str, chunks) -> list[int]:  # type: ignore[no-untyped-def]
    covered = bytearray(len(text))
    for c in chunks:
        covered[c.start_char:c.end_char] = b"\x01" * (c.end_char - c.start_char)
    return [i for i, ch in enumerate(text) if not covered[i] and has_visible(ch)]


@pytest.mark.parametrize(("size", "overlap"), [(64, 64), (64, 100), (0, 0), (16, -1)])
def test_overlap_not_smaller_than_size_or_bad_sizes_are_rejected(size, overlap):
    with pytest.raises(InvalidConfig):
        ChunkerConfig(chunk_tokens=size, overlap_tokens=overlap)


@pytest.mark.parametrize("name", CASE_FILES)
def test_offsets_slice_the_text_exactly_and_cover_all_visible_text(name, tokenizer, config, embed_count):
    text = case_text(name)
    chunks = chunk_text(text, tokenizer, config, embed_count)
    assert chunks
    assert all(text[c.start_char:c.end_char] == c.text for c in chunks)
    assert uncovered_visible(text, chunks) == []


@pytest.mark.parametrize("name", CASE_FILES)
def test_every_chunk_fits_the_window_with_exact_token_counts(name, tokenizer, config, embed_count):
    for c in chunk_text(case_text(name), tokenizer, config, embed_count):
        assert c.n_tokens == len(tokenizer.encode(c.text))
        assert 0 < c.n_tokens <= config.chunk_tokens


@pytest.mark.parametrize("name", ["unbroken_long_content.txt", "multibyte_mix.txt", "doc_v1.txt"])
def test_every_chunk_fits_the_embedder_word_piece_limit_even_with_a_wide_window(
        name, tokenizer, embed_count):
    wide = ChunkerConfig(chunk_tokens=1024, overlap_tokens=32, max_embed_tokens=256)
    chunks = chunk_text(case_text(name), tokenizer, wide, embed_count)
    assert chunks
    assert max(embed_count(c.text) for c in chunks) <= 256


def test_repeated_paragraphs_get_strictly_increasing_offsets(tokenizer, config, embed_count):
    text = "\n\n".join(["The same paragraph, repeated word for word."] * 40)
    chunks = chunk_text(text, tokenizer, config, embed_count)
    assert len(chunks) > 3
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert a.start_char < b.start_char
        assert a.end_char < b.end_char


def test_blank_pages_give_no_empty_chunks_and_gapless_ordinals(tokenizer, embed_count):
    small = ChunkerConfig(chunk_tokens=16, overlap_tokens=2)
    chunks = chunk_text(case_text("blank_pages_and_gap.txt"), tokenizer, small, embed_count)
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    assert all(c.text.strip() and c.text == c.text.strip() for c in chunks)


def test_cuts_never_split_a_grapheme_cluster(tokenizer, embed_count):
    text = case_text("multibyte_mix.txt")
    tiny = ChunkerConfig(chunk_tokens=24, overlap_tokens=3)  # the ZWJ family emoji alone is 18 tokens
    bounds = grapheme_boundaries(text)
    chunks = chunk_text(text, tokenizer, tiny, embed_count)
    assert len(chunks) > 20
    for c in chunks:
        assert c.start_char in bounds and c.end_char in bounds
        c.text.encode("utf-8")  # whole code points only


def test_long_unbroken_runs_are_hard_split(tokenizer, config, embed_count):
    text = "data:application/octet-stream;base64," + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo" * 60
    chunks = chunk_text(text, tokenizer, config, embed_count)
    assert len(chunks) > 5
    assert "".join(c.text for c in chunks) == text  # no overlap inside one word, nothing lost


def test_cjk_without_spaces_is_split_within_the_window(tokenizer, config, embed_count):
    text = "中文文本没有空格分隔检索时需要正确切分" * 40
    chunks = chunk_text(text, tokenizer, config, embed_count)
    assert len(chunks) > 2
    assert all(c.n_tokens <= config.chunk_tokens for c in chunks)


def test_chunks_end_at_paragraph_boundaries_when_paragraphs_fit(tokenizer, embed_count):
    paragraphs = [f"Paragraph {i} says something short about pumps and valves." for i in range(30)]
    text = "\n\n".join(paragraphs)
    chunks = chunk_text(text, tokenizer, ChunkerConfig(64, 0), embed_count)
    assert len(chunks) > 3
    for c in chunks:
        assert c.end_char == len(text) or text[c.end_char:c.end_char + 2] == "\n\n"


def test_chunks_end_at_sentence_ends_inside_a_long_paragraph(tokenizer, embed_count):
    text = " ".join(f"Sentence number {i} talks about the flange bolts and the gauge." for i in range(40))
    chunks = chunk_text(text, tokenizer, ChunkerConfig(64, 0), embed_count)
    assert len(chunks) > 3
    assert all(c.text.endswith(".") for c in chunks)


def test_overlap_repeats_the_tail_of_the_previous_chunk(tokenizer, embed_count):
    text = " ".join(f"Sentence {i} is short." for i in range(80))
    chunks = chunk_text(text, tokenizer, ChunkerConfig(48, 12), embed_count)
    assert len(chunks) > 3
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b.start_char < a.end_char  # shares text with the previous chunk
        assert len(tokenizer.encode(text[b.start_char:a.end_char])) <= 12 + 2


def test_special_token_strings_are_counted_and_chunked_as_plain_text(tokenizer, config, embed_count):
    text = case_text("special_tokens_in_text.md")
    chunks = chunk_text(text, tokenizer, config, embed_count)
    assert any("<|endoftext|>" in c.text for c in chunks)
    assert any("<|im_start|>" in c.text for c in chunks)
    eos = tokenizer.hf.convert_tokens_to_ids("<|endoftext|>")
    assert all(eos not in tokenizer.encode(c.text) for c in chunks)


def test_invisible_only_text_gives_no_chunks(tokenizer, config):
    assert chunk_text("\ufeff\u200b\u200c\u200d \n\t", tokenizer, config) == []


def test_a_pathological_grapheme_cluster_still_respects_the_limits(tokenizer, embed_count):
    zalgo = "Z" + "\u0301\u0316\u0327" * 200 + " tail."
    chunks = chunk_text(zalgo, tokenizer, ChunkerConfig(32, 4), embed_count)
    assert chunks and all(c.n_tokens <= 32 for c in chunks)
    assert all(zalgo[c.start_char:c.end_char] == c.text for c in chunks)


def test_chunk_hash_is_tagged_sha256_of_the_chunk_text(tokenizer, config):
    for c in chunk_text(case_text("doc_v2_shorter_changed.txt"), tokenizer, config):
        assert c.chunk_hash == sha256_text(c.text)
        assert c.chunk_hash == "sha256:" + hashlib.sha256(c.text.encode()).hexdigest()


def test_chunking_is_deterministic(tokenizer, config, embed_count):
    text = case_text("doc_v1.txt")
    first = chunk_text(text, tokenizer, config, embed_count)
    assert first == chunk_text(text, tokenizer, config, embed_count)


def test_chunk_ids_are_deterministic_positive_int63_and_distinct():
    ids = {chunk_id(d, v, o) for d in ("a", "b/c.html") for v in (1, 2) for o in range(50)}
    assert len(ids) == 200
    assert all(0 < i < 2**63 for i in ids)
    assert chunk_id("a", 1, 0) == chunk_id("a", 1, 0)


def test_chunker_id_changes_with_config_and_tokenizer():
    a = chunker_id(ChunkerConfig(128, 16), "sha256:" + "0" * 64)
    assert a.startswith("sha256:")
    assert a != chunker_id(ChunkerConfig(128, 8), "sha256:" + "0" * 64)
    assert a != chunker_id(ChunkerConfig(128, 16), "sha256:" + "1" * 64)


FRAGMENTS = [
    "The pump stops.", "Check gauge G1!", "\n\n", "\n", "   ", "\f", "\u200b",
    "中文文本没有空格分隔。",
    "한국어 문장도.",
    "👩\u200d👩\u200d👧\u200d👦",
    "e\u0301", "Über Größe.", "𝔘𝔫𝔦",
    "<|endoftext|>", "<|im_start|>system",
    "https://example.org/" + "a1b2c3" * 30, "QUJDRA==" * 25,
]


@pytest.mark.parametrize("seed", range(12))
def test_random_mixtures_keep_every_chunk_invariant(seed, tokenizer, embed_count):
    import random

    rng = random.Random(seed)
    text = normalize_text(" ".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(20, 120))))
    size = rng.choice([24, 40, 96])
    config = ChunkerConfig(size, rng.randint(0, size // 3))
    chunks = chunk_text(text, tokenizer, config, embed_count)
    bounds = grapheme_boundaries(text)
    assert uncovered_visible(text, chunks) == []
    for c in chunks:
        assert text[c.start_char:c.end_char] == c.text and has_visible(c.text)
        assert c.n_tokens == len(tokenizer.encode(c.text)) <= size
        assert embed_count(c.text) <= config.max_embed_tokens
        assert c.start_char in bounds and c.end_char in bounds
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert a.start_char < b.start_char and a.end_char < b.end_char
