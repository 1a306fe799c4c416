"""The document-id grammar: what an id may be, so that every id works on every backend and client.

A document id is the caller's name for a document (``guides/setup.md``,
``runbooks/versions``): ``/``-separated segments. Ids are NFC-normalised before
anything else, so a file name spelled in NFD (a folder synced from macOS) names
the same document as its NFC spelling. After that, an id must keep every rule
of :data:`RULES`; the first rule broken is named in the error
(``InvalidDocumentId``, code ``invalid_document_id``, ``details.rule``).

Why each rule:

* ``empty``, ``too_long``: an id is a key. The limit is
  :data:`MAX_DOCUMENT_ID_BYTES` UTF-8 bytes, not characters: PostgreSQL refuses a
  btree index entry over 2704 bytes (a third of an 8 KiB page), and the id is
  part of three indexes (``documents`` primary key, ``document_versions
  (document_id, version)``, ``receipt_documents`` primary key); 1024 bytes keeps
  every entry far below that on every backend.
* ``leading_slash``, ``empty_segment``, ``dot_segment``: HTTP clients (curl,
  httpx, requests, browsers) normalise URL paths (RFC 3986 section 5.2.4 removes
  ``.`` and ``..`` segments; several collapse ``//``), so such an id in a URL
  would reach another document or none.
* ``surrounding_whitespace``: invisible in listings and lost by shells and forms.
* ``control_character`` (Cc), ``format_character`` (Cf: zero-width characters,
  bidi overrides such as U+202E, soft hyphens), ``line_separator`` (Zl, Zp): they
  are invisible or reorder text, so two different ids would look the same in a
  listing (spoofing), or they break log lines.
* ``not_unicode``: lone surrogates (a file name that is not valid UTF-8, decoded
  with ``surrogateescape``) cannot be stored as UTF-8.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from foundation.bounds import check_text
from foundation.errors import InvalidDocumentId

#: Upper bound on an id's UTF-8 length (see the module docstring for why bytes, and why 1024).
MAX_DOCUMENT_ID_BYTES = 1024

#: rule -> what it requires, in the order they are checked.
RULES: dict[str, str] = {
    "empty": "an id is a non-empty string",
    "not_unicode": "an id is valid Unicode (no lone surrogates, e.g. from a file name that is not UTF-8)",
    "too_long": f"an id is at most {MAX_DOCUMENT_ID_BYTES} bytes in UTF-8",
    "surrounding_whitespace": "an id does not start or end with whitespace",
    "control_character": "an id holds no control characters (Unicode Cc)",
    "format_character": "an id holds no invisible format characters (Unicode Cf: zero-width, bidi controls)",
    "line_separator": "an id holds no line or paragraph separators (Unicode Zl, Zp)",
    "leading_slash": "an id does not start with '/'",
    "empty_segment": "an id has no empty segment ('a//b' or a trailing '/')",
    "dot_segment": "an id has no '.' or '..' segment",
}


def printable(text: str) -> str:
    """``text`` safe to print and store as UTF-8: bytes of a non-UTF-8 file name (decoded with
    ``surrogateescape``) and other lone surrogates are shown as backslash escapes (``\\xe9``)."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _broken(rule: str, document_id: str, **details: Any) -> InvalidDocumentId:
    shown = printable(document_id)
    return InvalidDocumentId(f"invalid document id {shown[:80]!r}: {RULES[rule]} (rule {rule})",
                             rule=rule, **details)


def normalize_document_id(document_id: str) -> str:
    """The NFC form of ``document_id``: the key under which it is stored and looked up. Lone
    surrogates (which no stored id holds) become "?", so a lookup finds nothing instead of
    failing to encode."""
    if any(0xD800 <= ord(c) <= 0xDFFF for c in document_id):
        document_id = document_id.encode("utf-8", "replace").decode("utf-8")
    return unicodedata.normalize("NFC", document_id)


def lookup_document_id(document_id: str) -> str:
    """The key to look ``document_id`` up by (its NFC form, :func:`normalize_document_id`), after
    the checks every backend needs (:func:`foundation.bounds.check_text`: no NUL, at most
    ``MAX_DOCUMENT_ID_BYTES`` bytes). The grammar is not applied, so an id stored before a rule
    existed can still be read and deleted.

    Raises:
        InvalidInput: rule ``nul_character``, ``not_text`` or ``too_long`` (``details["field"]`` is
            ``document_id``); no stored id can break these.
    """
    if not isinstance(document_id, str):
        check_text(document_id, "document_id", max_bytes=MAX_DOCUMENT_ID_BYTES)
    return check_text(normalize_document_id(document_id), "document_id", max_bytes=MAX_DOCUMENT_ID_BYTES)


def check_document_id(document_id: object) -> str:
    """Return the NFC form of ``document_id`` when it keeps every rule of :data:`RULES`.

    Raises:
        InvalidDocumentId: the first rule broken, named in ``details["rule"]``.
    """
    if not isinstance(document_id, str) or not document_id:
        raise InvalidDocumentId(f"invalid document id: {RULES['empty']} (rule empty)", rule="empty")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in document_id):
        raise _broken("not_unicode", document_id)
    doc_id = normalize_document_id(document_id)
    size = len(doc_id.encode("utf-8"))
    if size > MAX_DOCUMENT_ID_BYTES:
        raise _broken("too_long", doc_id, size_bytes=size, limit_bytes=MAX_DOCUMENT_ID_BYTES)
    if doc_id != doc_id.strip():
        raise _broken("surrounding_whitespace", doc_id)
    for i, c in enumerate(doc_id):
        cat = unicodedata.category(c)
        rule = {"Cc": "control_character", "Cf": "format_character", "Zl": "line_separator",
                "Zp": "line_separator"}.get(cat)
        if rule is not None:
            raise _broken(rule, doc_id, position=i, character=f"U+{ord(c):04X}")
    if doc_id.startswith("/"):
        raise _broken("leading_slash", doc_id)
    segments = doc_id.split("/")
    if any(seg == "" for seg in segments):
        raise _broken("empty_segment", doc_id)
    if any(seg in (".", "..") for seg in segments):
        raise _broken("dot_segment", doc_id)
    return doc_id
