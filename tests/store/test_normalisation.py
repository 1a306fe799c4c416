"""Text normalisation, rule by rule (docs/store.md), on documents and questions alike."""

from __future__ import annotations

import unicodedata

import pytest

from app.settings import get_settings
from app.validation import check_question
from foundation.db import read_session
from foundation.errors import InvalidInput
from foundation.hashing import normalize_text
from retrieval.extract import extract_text
from retrieval.store import IngestItem, get_version


@pytest.mark.parametrize(("raw", "expected"), [
    ("a\r\nb\rc", "a\nb\nc"),                                        # 1 newlines
    ("BGWORKER_BACKEND_\u200bDATABASE", "BGWORKER_BACKEND_DATABASE"),  # 2 zero-width space
    ("co\u00adoperate", "cooperate"),                                 # 2 soft hyphen
    ("word\u2060joiner\u200cnon", "wordjoinernon"),                   # 2 word joiner, ZWNJ
    ("\ufeffstart mid\ufeffdle", "start middle"),                     # 2 U+FEFF anywhere
    ("a\u200db", "ab"),                                               # 3 a lone ZWJ
    ("pg_dump\u00a0-Fc\u202fdb\u2007x", "pg_dump -Fc db x"),          # 4 no-break spaces
    ("e\u200b\u0301", "\u00e9"),                                      # 5 NFC after the removals
])
def test_each_rule(raw: str, expected: str) -> None:
    assert normalize_text(raw) == expected


@pytest.mark.parametrize("emoji", ["\U0001f469\u200d\u2695\ufe0f",
                                   "\U0001f468\u200d\U0001f469\u200d\U0001f467",
                                   "\U0001f3f3\ufe0f\u200d\U0001f308"])
def test_a_zero_width_joiner_inside_an_emoji_sequence_is_kept(emoji: str) -> None:
    assert normalize_text(f"team {emoji} on call") == f"team {emoji} on call"


def test_normalisation_is_idempotent_on_mixed_text() -> None:
    text = "x\u200b\u00ady\u00a0z\r\n\U0001f469\u200d\u2695\ufe0f e\u0301 \u200d"
    once = normalize_text(text)
    assert normalize_text(once) == once and once == unicodedata.normalize("NFC", once)


def test_stored_html_text_has_no_invisible_characters_inside_identifiers() -> None:
    html = ("<html><body><p>Use <code>BGWORKER_BACKEND_\u200bDATABASE_CONNECTION</code>.</p>"
            "<pre>pg_dump\u00a0-Fc mydb &gt; db.dump</pre><p>co&shy;operate</p></body></html>")
    text = extract_text(html.encode(), "html")
    assert "BGWORKER_BACKEND_DATABASE_CONNECTION" in text and "pg_dump -Fc mydb > db.dump" in text
    assert "cooperate" in text and not any(c in text for c in "\u200b\u00ad\u00a0")


def test_the_same_text_with_and_without_invisibles_is_one_unchanged_version(engine, ingest) -> None:
    ingest([IngestItem("bgw.txt", text="Set BGWORKER_BACKEND_DATABASE_CONNECTION.")])
    again = ingest([IngestItem("bgw.txt", text="Set BGWORKER_BACKEND_\u200bDATABASE_CONNECTION.")])
    assert again.revision is None and again.results[0].status == "unchanged"
    with read_session(engine) as s:
        assert get_version(s, "bgw.txt", 1).text == "Set BGWORKER_BACKEND_DATABASE_CONNECTION."


def test_questions_are_normalised_like_documents() -> None:
    settings = get_settings()
    assert check_question(settings, " What is BGWORKER_\u200bBACKEND?\u00a0") == "What is BGWORKER_BACKEND?"
    with pytest.raises(InvalidInput) as err:
        check_question(settings, "\u200b\ufeff\u00ad")
    assert err.value.code == "empty_question"
