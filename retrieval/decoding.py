"""Source bytes to text: byte-order marks, declared charsets, and a clear refusal otherwise.

Which encoding a file is read in, in this order (the order of the WHATWG
Encoding standard's "decode" and of the HTML parser's encoding sniffing):

1. A byte-order mark: UTF-8 (``EF BB BF``), UTF-16 LE/BE (``FF FE`` / ``FE FF``)
   or UTF-32 LE/BE (``FF FE 00 00`` / ``00 00 FE FF``; checked before UTF-16,
   whose mark is its prefix). The mark is dropped; the rest must decode.
2. HTML only: a charset the page declares in its first 1024 bytes: an XML
   declaration (``<?xml version="1.0" encoding="ISO-8859-1"?>``, XHTML) or a
   ``<meta charset=...>`` / ``<meta http-equiv="Content-Type"
   content="...; charset=...">``. A declared UTF-16 or UTF-32 in bytes that
   could be read to find it (no mark) is read as UTF-8, as the HTML standard
   says. An unknown charset name is refused.
3. Otherwise UTF-8.

Decoding is strict: a byte sequence the encoding cannot read is refused with
:class:`foundation.errors.InvalidEncoding` (code ``invalid_encoding``), naming
the encoding, where it came from and the byte offset; the ingest goes on with
the other files. Without a mark, NUL bytes mean binary content (a UTF-16 file
without a byte-order mark is refused as such, with that hint): no charset is
guessed, so a file's text, and its content hash, never depend on a detector's
version.
"""

from __future__ import annotations

import codecs
import re

from foundation.errors import InvalidEncoding

#: Byte-order marks and their codecs, longest first where one is a prefix of another.
BOMS: tuple[tuple[bytes, str], ...] = (
    (codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"),
)
PRESCAN_BYTES = 1024  # the HTML standard's prescan window
_XML_DECL = re.compile(rb"""^\s*<\?xml\s[^>]*?\bencoding\s*=\s*["']([A-Za-z0-9._:-]+)["']""")
_META_CHARSET = re.compile(rb"""<meta\s[^>]*?\bcharset\s*=\s*["']?\s*([A-Za-z0-9._:-]+)""", re.IGNORECASE)


def bom_encoding(raw: bytes) -> tuple[str, int] | None:
    """``(codec, mark length)`` when ``raw`` starts with a byte-order mark, else None."""
    for mark, codec in BOMS:
        if raw.startswith(mark):
            return codec, len(mark)
    return None


def declared_charset(raw: bytes) -> str | None:
    """The charset an HTML page declares in its first :data:`PRESCAN_BYTES` bytes (XML
    declaration first, then the first ``<meta>`` with a charset), lower-cased; None if none."""
    head = raw[:PRESCAN_BYTES]
    m = _XML_DECL.match(head) or _META_CHARSET.search(head)
    return m.group(1).decode("ascii").lower() if m else None


def decode_source(raw: bytes, kind: str) -> str:
    """Decode ``raw`` (a document of ``kind``) as the module docstring says.

    Raises:
        InvalidEncoding: bytes the chosen encoding cannot read, an unknown declared charset,
            or NUL bytes without a byte-order mark (binary content).
    """
    bom = bom_encoding(raw)
    if bom is not None:
        codec, skip = bom
        return _decode(raw[skip:], codec, f"{codec.upper()}, from its byte-order mark", skip)
    if b"\x00" in raw:
        raise InvalidEncoding("binary content: the bytes contain NUL characters (a UTF-16 or UTF-32 "
                              "text needs a byte-order mark to be read)", offset=raw.index(b"\x00"))
    declared = declared_charset(raw) if kind == "html" else None
    if declared is None:
        return _decode(raw, "utf-8", "UTF-8: no byte-order mark and no declared charset", 0)
    try:
        codec = codecs.lookup(declared).name
    except LookupError as exc:
        raise InvalidEncoding(f"the page declares the charset {declared!r}, which is not known",
                              charset=declared) from exc
    if codec.startswith(("utf-16", "utf-32")):
        codec = "utf-8"  # the declaration was readable as ASCII, so the page is not UTF-16/32
    return _decode(raw, codec, f"{codec.upper()}, the charset the page declares", 0)


def _decode(data: bytes, codec: str, why: str, base: int) -> str:
    """``data`` decoded strictly with ``codec``; ``base`` is its offset in the file (a mark).

    Raises:
        InvalidEncoding: with the file offset of the first byte that does not decode.
    """
    try:
        return data.decode(codec)
    except UnicodeDecodeError as exc:
        name = "UTF-8" if codec == "utf-8" else codec.upper()
        raise InvalidEncoding(f"not valid {name} at byte {base + exc.start}: {exc.reason} (read as {why})",
                              offset=base + exc.start, encoding=codec) from exc
