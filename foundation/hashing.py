"""Hashing in one place: canonical bytes, algorithm-tagged SHA-256.

Contract (docs/architecture.md, "Contracts"):

* Every hash is written ``sha256:<64 lowercase hex>`` so the algorithm can change.
* Text is hashed over its normalised UTF-8 bytes (see :func:`normalize_text`).
* Records are hashed over canonical JSON: sorted keys, no insignificant
  whitespace, UTF-8, no NaN/Infinity (:func:`canonical_json`). This is *not*
  RFC 8785: Python writes ``1200.0``, ``1e-07`` and ``-0.0`` where RFC 8785
  writes ``1200``, ``1e-7`` and ``0``. It stays the form of every hash already
  stored (corpus roots, token-id hashes, embedder ids, version-1 receipts).
* Records meant to be verified outside Python (receipts from format version 2)
  use RFC 8785, the JSON Canonicalization Scheme (:func:`jcs_canonical`, the
  ``rfc8785`` library): ECMAScript number formatting, keys sorted by UTF-16
  code units, and integers only within +-(2**53 - 1), so a JavaScript or Go
  auditor with any JCS library gets the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from pathlib import Path
from typing import Any

from foundation.errors import InvalidInput

ALGORITHM = "sha256"
PREFIX = "sha256:"


def sha256_bytes(data: bytes) -> str:
    """Return ``sha256:<hex>`` of ``data``."""
    return PREFIX + hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Return ``sha256:<hex>`` of a file's bytes, read in ``chunk_bytes`` blocks.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return PREFIX + h.hexdigest()


#: Characters removed from text (rule 2 of :func:`normalize_text`): zero-width space (U+200B),
#: zero-width non-joiner (U+200C), word joiner (U+2060), zero-width no-break space / BOM
#: (U+FEFF), soft hyphen (U+00AD). The zero-width joiner (U+200D) is handled apart (rule 3).
INVISIBLE_REMOVED = "\u200b\u200c\u2060\ufeff\u00ad"
#: No-break spaces turned into a plain space (rule 4): U+00A0, narrow U+202F, figure U+2007.
NO_BREAK_SPACES = "\u00a0\u202f\u2007"
_TRANSLATE = {**{ord(c): None for c in INVISIBLE_REMOVED}, **{ord(c): " " for c in NO_BREAK_SPACES}}
# A ZWJ is kept only inside an emoji sequence: after a pictograph, an emoji modifier or VS16,
# and before a pictograph (e.g. U+1F469 U+200D U+2695 U+FE0F, "woman health worker").
_EMOJI = "\u2600-\u27bf\U0001f000-\U0001faff"
_LONE_ZWJ = re.compile(f"(?<![{_EMOJI}\ufe0f])\u200d|\u200d(?![{_EMOJI}])")


def normalize_text(text: str) -> str:
    """Normalise text before hashing, chunking, embedding or searching.

    The rules, in order (docs/store.md lists them with their reasons):

    1. newlines unified to ``\\n`` (``\\r\\n`` and a lone ``\\r``);
    2. :data:`INVISIBLE_REMOVED` characters removed (zero-width space and non-joiner,
       word joiner, U+FEFF anywhere, soft hyphen);
    3. a zero-width joiner (U+200D) removed unless it joins an emoji sequence;
    4. :data:`NO_BREAK_SPACES` replaced by a plain space;
    5. Unicode NFC, applied once, last (removals can bring combining marks together).

    Documents (``retrieval.extract``), queries (``retrieval.retriever``) and questions
    (``app.validation``) all pass through it, so an identifier copied with a zero-width
    space matches the stored one. Idempotent: ``normalize_text(normalize_text(t)) ==
    normalize_text(t)``.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n").translate(_TRANSLATE)
    if "\u200d" in text:
        text = _LONE_ZWJ.sub("", text)
    return unicodedata.normalize("NFC", text)


def sha256_text(text: str) -> str:
    """Return ``sha256:<hex>`` of the UTF-8 bytes of already-normalised ``text``."""
    return sha256_bytes(text.encode("utf-8"))


def canonical_json(obj: Any) -> bytes:
    """Serialise ``obj`` to canonical JSON bytes.

    Sorted keys, separators ``(",", ":")``, UTF-8 (no ASCII escaping), NaN and
    infinities rejected.

    Raises:
        InvalidInput: ``obj`` holds a value JSON cannot represent exactly.
    """
    try:
        return json.dumps(
            obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"value is not canonical-JSON serialisable: {exc}") from exc


#: Largest integer every JSON reader holds exactly (JavaScript's ``Number.MAX_SAFE_INTEGER``).
MAX_SAFE_INTEGER = 2**53 - 1


def jcs_canonical(obj: Any) -> bytes:
    """Serialise ``obj`` per RFC 8785 (JSON Canonicalization Scheme), via the ``rfc8785`` library.

    Raises:
        InvalidInput: ``obj`` holds NaN or an infinity, an integer outside
            ``+-MAX_SAFE_INTEGER`` (RFC 8785 section 3.2.2.3: numbers are IEEE-754
            doubles; a larger integer must travel as a string), a string that is not
            valid Unicode (a lone surrogate), or a value that is not JSON.
    """
    import rfc8785

    try:
        return rfc8785.dumps(obj)
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as exc:
        raise InvalidInput(f"value is not RFC 8785 serialisable: {exc}") from exc


def sha256_json(obj: Any) -> str:
    """Return ``sha256:<hex>`` over :func:`canonical_json` of ``obj``."""
    return sha256_bytes(canonical_json(obj))


def sha256_ints(ids: list[int]) -> str:
    """Hash a token-id sequence: SHA-256 over canonical JSON of the list of ints."""
    return sha256_json([int(i) for i in ids])


def is_tagged_hash(value: str) -> bool:
    """True when ``value`` looks like ``sha256:<64 lowercase hex>``."""
    if not value.startswith(PREFIX) or len(value) != len(PREFIX) + 64:
        return False
    return all(c in "0123456789abcdef" for c in value[len(PREFIX):])
