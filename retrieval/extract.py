"""Turning source bytes into the text a model reads: decoding, HTML extraction, validation.

Decoding (byte-order marks, declared charsets) is :mod:`retrieval.decoding`; Markdown's front
matter and HTML comments are :mod:`retrieval.markdown`; :func:`extract` runs the whole path.

A document version's content is the *extracted, normalised* text, never the
markup: two HTML files that differ only in attributes, generated ids or the
navigation chrome give the same text and the same content hash. The source
bytes' hash is kept separately (``source_hash``).

HTML is parsed with BeautifulSoup over lxml, then:

1. *Main content.* When the page marks its main content (``<main>``, or an
   element with ``role="main"``, as Sphinx's ``div.body`` has), only the first
   such element is kept. Site chrome is dropped wherever it stands: ``<header>``,
   ``<nav>``, ``<footer>``, ``<aside>`` and elements with the ARIA roles
   ``banner``, ``navigation``, ``contentinfo``, ``complementary`` or ``search``
   (a ``<header>``/``<footer>`` inside an ``<article>`` or ``<section>`` is that
   section's own heading block and is kept), the DocBook navigation header and
   footer (``div.navheader`` / ``div.navfooter``, which carry the release
   number, e.g. "PostgreSQL 15.18 Documentation"), Sphinx permalink anchors
   (``a.headerlink``, the ``¶`` after each heading), ``<script>``, ``<style>``
   and other non-text elements.
2. *Text.* Block elements are separated by blank lines, inline whitespace is
   collapsed as a browser would, list items are prefixed with ``- ``.
   ``<pre>`` is kept verbatim with its line breaks, ``<br>`` included (code
   blocks of syntax highlighters often separate lines only with ``<br>``).
   Each table row is one line with its cells joined by `` | ``; block content
   inside a cell (paragraphs, lists) is joined into the cell with spaces, so a
   row never falls apart into loose blocks.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from foundation.errors import EmptyContent, InvalidEncoding, UnsupportedType
from foundation.hashing import normalize_text
from retrieval.decoding import decode_source
from retrieval.markdown import markdown_text

#: Document kinds and the file suffixes that map to them.
SUFFIX_KINDS = {".txt": "txt", ".md": "md", ".rst": "rst", ".html": "html", ".htm": "html"}
KINDS = frozenset(SUFFIX_KINDS.values())

_SKIP_TAGS = frozenset({"script", "style", "head", "title", "noscript", "template", "iframe", "object",
                        "nav", "aside", "button", "svg"})
_SKIP_CLASSES = frozenset({"navheader", "navfooter", "headerlink"})
_CHROME_TAGS = frozenset({"header", "footer"})  # dropped unless inside an article or section
_CHROME_ROLES = frozenset({"banner", "navigation", "contentinfo", "complementary", "search"})
_BLOCK_TAGS = frozenset({
    "address", "article", "aside", "blockquote", "body", "caption", "dd", "details", "div", "dl", "dt",
    "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header",
    "hr", "li", "main", "nav", "ol", "p", "pre", "section", "summary", "table", "tbody", "tfoot",
    "thead", "tr", "ul", "html",
})
_CELL_TAGS = frozenset({"td", "th"})
_WS = re.compile(r"[ \t\n\r\f\v]+")
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})


def kind_for_suffix(name: str) -> str:
    """The document kind for a file name (``.txt .md .rst .html .htm``).

    Raises:
        UnsupportedType: any other suffix.
    """
    suffix = "." + name.rsplit(".", 1)[-1].lower() if "." in name else ""
    kind = SUFFIX_KINDS.get(suffix)
    if kind is None:
        raise UnsupportedType(
            f"unsupported file type {suffix or '(no suffix)'!r}; expected one of "
            f"{', '.join(sorted(SUFFIX_KINDS))}", suffix=suffix)
    return kind


def check_kind(kind: str) -> str:
    """Return ``kind`` if it is one of :data:`KINDS`, else raise :class:`UnsupportedType`."""
    if kind not in KINDS:
        raise UnsupportedType(f"unsupported document kind {kind!r}; expected one of "
                              f"{', '.join(sorted(KINDS))}", kind=kind)
    return kind


def decode_utf8(raw: bytes) -> str:
    """Decode ``raw`` as a plain-text document: its byte-order mark (UTF-8/16/32), else strict UTF-8
    (:func:`retrieval.decoding.decode_source`).

    Raises:
        InvalidEncoding: NUL bytes without a byte-order mark (binary content) or bytes the
            encoding cannot read.
    """
    return decode_source(raw, "txt")


def check_text(text: str) -> str:
    """Reject text that cannot be stored as UTF-8 in both backends.

    Raises:
        InvalidEncoding: NUL characters (PostgreSQL ``text`` cannot hold them) or
            lone surrogates (not encodable as UTF-8).
    """
    if "\x00" in text:
        raise InvalidEncoding("text contains NUL characters", offset=text.index("\x00"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidEncoding(f"text is not encodable as UTF-8 at character {exc.start} "
                              f"(lone surrogate)", offset=exc.start) from exc
    return text


def has_visible_content(text: str) -> bool:
    """True when ``text`` holds at least one character that is not whitespace or invisible.

    Invisible: Unicode categories Cc, Cf (zero-width space/joiners, BOM, word
    joiner), Zs, Zl, Zp.
    """
    return any(not c.isspace() and unicodedata.category(c) not in _INVISIBLE_CATEGORIES for c in text)


def html_to_text(html: bytes | str) -> str:
    """The visible body text of an HTML page (see the module docstring for the rules).

    Returns un-normalised text with ``\\n`` line ends, blocks separated by one
    blank line, no trailing spaces on lines, stripped at both ends.
    """
    import warnings

    from bs4 import BeautifulSoup, XMLParsedAsHTMLWarning

    with warnings.catch_warnings():
        # XHTML pages (the PostgreSQL docs) start with an XML declaration; lxml's HTML
        # parser reads them correctly, and it is the lenient parser we want.
        warnings.simplefilter("ignore", XMLParsedAsHTMLWarning)
        soup = BeautifulSoup(html, "lxml")
    root = _main_content(soup)
    out = _TextBuilder()
    _walk(root, out, pre=False)
    return out.finish()


def _main_content(soup: Any) -> Any:
    """The page's marked main content (first ``<main>`` or ``role="main"``), else ``<body>``."""
    main = soup.find("main") or soup.find(attrs={"role": "main"})
    return main or soup.body or soup


def _is_chrome(tag: Any, name: str) -> bool:
    """Site chrome to drop: see step 1 of the module docstring."""
    role = str(tag.get("role") or "").lower()
    if role in _CHROME_ROLES:
        return True
    if name in _CHROME_TAGS:
        return tag.find_parent(["article", "section", "main"]) is None
    return bool(_SKIP_CLASSES.intersection(tag.get("class") or ()))


class _TextBuilder:
    """Collects inline text into blocks; a block ends at every block-element boundary."""

    def __init__(self) -> None:
        self.blocks: list[str] = []
        self.parts: list[str] = []
        self.prefix = ""

    def text(self, s: str, pre: bool) -> None:
        if not pre:
            s = _WS.sub(" ", s)
            if not self.parts or self.parts[-1].endswith((" ", "\n")):
                s = s.lstrip(" ")
        if s:
            self.parts.append(s)

    def raw_block(self, s: str) -> None:
        self.flush()
        s = "\n".join(line.rstrip() for line in s.strip("\n").split("\n"))
        if s.strip():
            self.blocks.append(self._take_prefix() + s)

    def newline(self) -> None:
        self.parts.append("\n")

    def flush(self) -> None:
        joined = "".join(self.parts)
        self.parts = []
        lines = [line.strip(" ") for line in joined.split("\n")]
        block = "\n".join(line for line in lines if line)
        if block:
            self.blocks.append(self._take_prefix() + block)

    def _take_prefix(self) -> str:
        p, self.prefix = self.prefix, ""
        return p

    def finish(self) -> str:
        self.flush()
        return "\n\n".join(self.blocks).strip()


def _walk(node: Any, out: _TextBuilder, pre: bool, cell: bool = False) -> None:
    from bs4 import Comment, Declaration, Doctype, NavigableString, ProcessingInstruction, Tag

    for child in node.children:
        if isinstance(child, Comment | Declaration | Doctype | ProcessingInstruction):
            continue
        if isinstance(child, NavigableString):
            out.text(str(child), pre)
            continue
        if not isinstance(child, Tag):
            continue
        name = child.name.lower() if child.name else ""
        if name in _SKIP_TAGS or _is_chrome(child, name):
            continue
        if name == "br":
            out.text(" ", pre=False) if cell else out.newline()
        elif name == "pre":
            if cell:
                out.text(" " + _pre_text(child).replace("\n", " ") + " ", pre=False)
            else:
                out.raw_block(_pre_text(child))
        elif name == "tr":
            out.flush()
            _walk(child, out, pre, cell=False)
            out.flush()
        elif name in _CELL_TAGS:
            if out.parts and "".join(out.parts).strip():
                while out.parts and out.parts[-1].endswith(" "):
                    out.parts[-1] = out.parts[-1].rstrip(" ")
                out.text(" | ", pre=True)
            _walk(child, out, pre, cell=True)
        elif name in _BLOCK_TAGS and cell:
            out.text(" ", pre=False)
            _walk(child, out, pre, cell=True)
            out.text(" ", pre=False)
        elif name in _BLOCK_TAGS:
            out.flush()
            if name == "li":
                out.prefix = "- "
            _walk(child, out, pre)
            out.flush()
        else:
            _walk(child, out, pre, cell)


def _pre_text(pre: Any) -> str:
    """The text of a ``<pre>`` element with each ``<br>`` as a line break (and the chrome of step 1,
    e.g. a copy button, left out)."""
    from bs4 import NavigableString, Tag

    parts: list[str] = []

    def visit(node: Any) -> None:
        for child in node.children:
            if isinstance(child, NavigableString):
                if type(child) is NavigableString or child.__class__.__name__ == "CData":
                    parts.append(str(child))
            elif isinstance(child, Tag):
                name = child.name.lower() if child.name else ""
                if name == "br":
                    parts.append("\n")
                elif name not in _SKIP_TAGS and not _is_chrome(child, name):
                    visit(child)

    visit(pre)
    return "".join(parts)


@dataclass(frozen=True)
class Extracted:
    """A document's text to index and, for Markdown with YAML front matter, that front matter."""

    text: str
    front_matter: dict[str, Any] | None = None


def extract(kind: str, *, raw: bytes | None = None, text: str | None = None) -> Extracted:
    """Decode ``raw`` (:mod:`retrieval.decoding`: byte-order mark, an HTML page's declared
    charset, else UTF-8), or take ``text`` as given, and extract what a model reads: HTML's
    visible body text (comments dropped by the parser); Markdown without its front matter
    (returned apart) and HTML comments (:mod:`retrieval.markdown`); normalised
    (:func:`finish_text`).

    Raises:
        UnsupportedType: unknown ``kind``.
        InvalidEncoding: bytes that cannot be decoded (see :mod:`retrieval.decoding`).
        InvalidInput (``invalid_front_matter``): Markdown front matter that is not valid YAML.
        EmptyContent: nothing visible is left.
    """
    check_kind(kind)
    if (raw is None) == (text is None):
        raise ValueError("give exactly one of raw or text")
    decoded = decode_source(raw, kind) if raw is not None else str(text)
    front: dict[str, Any] | None = None
    if kind == "html":
        decoded = html_to_text(decoded)
    elif kind == "md":
        decoded, front = markdown_text(normalize_text(check_text(decoded)))
    return Extracted(finish_text(decoded), front)


def extract_text(raw: bytes, kind: str) -> str:
    """The text of :func:`extract` for source bytes (front matter left out).

    Raises:
        as :func:`extract`.
    """
    return extract(kind, raw=raw).text


def finish_text(text: str) -> str:
    """Validate and normalise already-decoded text.

    Raises:
        InvalidEncoding: NUL or lone surrogates.
        EmptyContent: empty, whitespace-only or invisible-only text.
    """
    text = normalize_text(check_text(text))
    if not has_visible_content(text):
        raise EmptyContent("no visible content: the text is empty, whitespace-only or made of "
                           "invisible characters only")
    return text
