"""A receipt body's canonical bytes and hash, for each format version.

* Format version 1: Python's canonical JSON (:func:`foundation.hashing.canonical_json`:
  sorted keys, ``(",", ":")`` separators, UTF-8). Kept only to verify receipts
  written before version 2; no new receipt uses it.
* Format version 2 and later: RFC 8785, the JSON Canonicalization Scheme
  (:func:`foundation.hashing.jcs_canonical`), so any JCS library in any
  language reproduces the bytes, and no integer in the body exceeds
  2**53 - 1 (chunk ids travel as decimal strings).

A body's version is its own ``format_version`` field (part of the hashed
bytes). The stored text of every receipt is the canonical form of the body with
its hash; :func:`stored_form_problem` checks that byte for byte, so a stored
body that was pretty-printed or carries a duplicated key is an edited body even
when its parsed content still hashes correctly.
"""

from __future__ import annotations

import json
from typing import Any

from foundation.errors import IntegrityFailure
from foundation.hashing import canonical_json, jcs_canonical, sha256_bytes

#: The first format version canonicalised per RFC 8785.
JCS_FROM_VERSION = 2


def uses_jcs(body: dict[str, Any]) -> bool:
    """True when ``body`` is canonicalised per RFC 8785 (``format_version >= 2``).

    A body without an integer ``format_version`` (only ever an edited one) is
    read with the version-1 form, so its hash recomputes to something, reported
    as a mismatch rather than as a crash.
    """
    version = body.get("format_version")
    return isinstance(version, int) and not isinstance(version, bool) and version >= JCS_FROM_VERSION


def canonical_body(body: dict[str, Any]) -> bytes:
    """The canonical bytes of ``body`` in the form its ``format_version`` prescribes.

    Raises:
        InvalidInput: a version-2 body holds a value RFC 8785 cannot carry (an
            integer beyond 2**53 - 1, NaN, a lone surrogate).
    """
    return jcs_canonical(body) if uses_jcs(body) else canonical_json(body)


def receipt_hash(body: dict[str, Any]) -> str:
    """``sha256:`` over :func:`canonical_body` of ``body`` without its ``hash`` field."""
    return sha256_bytes(canonical_body({k: v for k, v in body.items() if k != "hash"}))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise IntegrityFailure(f"stored receipt body has the key {key!r} twice", key=key)
        seen[key] = value
    return seen


def stored_form_problem(text: str) -> str | None:
    """Why ``text`` (a stored body) is not byte for byte the canonical form of itself; None if it is.

    Checks, in order: the text is a JSON object without a duplicated key (a
    reader keeps one of the two values, so the other was hidden from every
    hash); re-serialising the parsed body in its version's canonical form gives
    exactly ``text`` (pretty-printing, reordered keys, ``1200.0`` in a version-2
    body or escaped characters all differ).
    """
    try:
        body = json.loads(text, object_pairs_hook=_no_duplicates)
    except IntegrityFailure as exc:
        return exc.message
    except ValueError as exc:
        return f"not JSON: {exc}"
    if not isinstance(body, dict):
        return "not a JSON object"
    try:
        canonical = canonical_body(body)
    except Exception as exc:  # noqa: BLE001 - any value the canonical form refuses is a finding
        return f"cannot be put in canonical form: {exc}"
    if canonical != text.encode("utf-8"):
        form = "RFC 8785" if uses_jcs(body) else "version-1 canonical JSON"
        at = next((i for i, (a, b) in enumerate(zip(canonical, text.encode("utf-8"), strict=False))
                   if a != b), min(len(canonical), len(text.encode("utf-8"))))
        return (f"the stored bytes are not the {form} form of the body they hold "
                f"(first difference at byte {at}): re-serialised after the hash was taken")
    return None
