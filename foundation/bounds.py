"""What every backend accepts: the checks a value passes before it reaches a query.

SQLite and PostgreSQL differ at the edges: PostgreSQL refuses a NUL character in
text (psycopg: "PostgreSQL text fields cannot contain NUL (0x00) bytes"), a lone
surrogate cannot be encoded to UTF-8 for either driver, PostgreSQL's ``bigint`` and
SQLite's ``INTEGER`` hold signed 64-bit integers only, and a time must stay within
years 1..9999 after conversion to UTC (Python's ``datetime``, which both stored
forms are read back into). Every id, filter and cursor that comes from a caller
passes one of these functions first, so both backends answer the same way: an
:class:`~foundation.errors.InvalidInput` naming the field and the broken rule
(``details["field"]``, ``details["rule"]``), never a driver error.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from foundation.errors import InvalidInput

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
_DIGITS = re.compile(r"[0-9]{1,64}")  # ASCII digits only: "²" is a digit to str.isdigit(), not to int()


def _bad(field: str, rule: str, message: str) -> InvalidInput:
    return InvalidInput(f"{field}: {message}", field=field, rule=rule)


def check_text(value: object, field: str, *, max_bytes: int) -> str:
    """``value`` unchanged when it is a str every backend stores and compares.

    Rules (``details["rule"]``): ``not_text`` (not a str), ``nul_character`` (U+0000),
    ``not_unicode`` (a lone surrogate, not encodable as UTF-8), ``too_long`` (over
    ``max_bytes`` bytes of UTF-8; bytes, not characters, because that is what a column holds).

    Raises:
        InvalidInput: the first broken rule.
    """
    if not isinstance(value, str):
        raise _bad(field, "not_text", "must be a string")
    if "\x00" in value:
        raise _bad(field, "nul_character", "must not contain a NUL character (U+0000)")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise _bad(field, "not_unicode", "must be valid Unicode (no lone surrogates)") from exc
    if size > max_bytes:
        raise _bad(field, "too_long", f"must be at most {max_bytes} bytes of UTF-8, got {size}")
    return value


def check_int64(value: object, field: str, *, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """``value`` when it is an int (not a bool) in ``[lo, hi]`` (clamped to the signed 64-bit range).

    Raises:
        InvalidInput: rule ``not_integer`` or ``out_of_range``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(field, "not_integer", "must be an integer")
    lo, hi = max(lo, INT64_MIN), min(hi, INT64_MAX)
    if not lo <= value <= hi:
        raise _bad(field, "out_of_range", f"must be in [{lo}, {hi}], got {value}")
    return value


def parse_decimal_int64(text: object, field: str, *, lo: int = 0, hi: int = INT64_MAX) -> int:
    """A cursor or id given as text: ASCII decimal digits only, within ``[lo, hi]``.

    Raises:
        InvalidInput: rule ``not_integer`` (anything but 1..19 ASCII digits) or ``out_of_range``.
    """
    if not isinstance(text, str) or not _DIGITS.fullmatch(text):
        raise _bad(field, "not_integer", "must be a decimal integer (ASCII digits)")
    return check_int64(int(text), field, lo=lo, hi=hi)


def parse_utc_time(value: str | datetime, field: str) -> datetime:
    """An ISO-8601 time (``Z`` accepted; naive means UTC) as an aware UTC datetime.

    Raises:
        InvalidInput: rule ``not_a_time`` (unparseable, or a NUL inside) or ``out_of_range``
            (outside years 1..9999 once converted to UTC, e.g. ``0001-01-01T00:00:00+01:00``).
    """
    if isinstance(value, str):
        check_text(value, field, max_bytes=64)
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError as exc:
            raise _bad(field, "not_a_time", f"must be an ISO-8601 time, got {value!r}") from exc
    if not isinstance(value, datetime):
        raise _bad(field, "not_a_time", "must be an ISO-8601 time")
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except (OverflowError, ValueError) as exc:
        raise _bad(field, "out_of_range", "is outside years 1..9999 once converted to UTC") from exc
