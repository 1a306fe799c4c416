"""Markdown before chunking: YAML front matter kept as metadata, HTML comments dropped.

*Front matter* (Jekyll, Hugo, MkDocs, Docusaurus): a document whose first line
is ``---`` and that has a later line ``---`` (or ``...``) between which stands a
YAML mapping. The block is parsed with PyYAML's ``safe_load`` (no object
construction) and kept as the version's metadata (``metadata_json["front_matter"]``),
never as text: a title, tags, an author or a deploy token in it are not indexed,
ranked or shown to a model. Values YAML reads as dates become ISO-8601 strings.
A block that is not valid YAML is refused (``invalid_front_matter``) rather
than indexed; a block that is YAML but not a mapping (``---`` / a line / ``---``
is a thematic break and a heading in CommonMark) is text.

*HTML comments* (``<!-- ... -->``) are not rendered, so they are not text: they
are dropped, across lines too, except inside fenced code blocks (```` ``` ````
or ``~~~``) and inline code spans, where they are shown literally. A comment
that is never closed runs to the end of the document, as a browser reads it.
(In HTML documents the parser drops comments: :mod:`retrieval.extract`.)
"""

from __future__ import annotations

import datetime as dt
import math
import re
from typing import Any

from foundation.errors import InvalidInput, TooLarge

_OPEN = re.compile(r"\A---[ \t]*\r?\n")
_CLOSE = re.compile(r"^(?:---|\.\.\.)[ \t]*$", re.MULTILINE)
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_INLINE = re.compile(r"`+|<!--")
#: Values in a front matter block (after YAML aliases are expanded): more is refused, so an
#: alias bomb cannot blow up the metadata.
MAX_FRONT_MATTER_NODES = 10_000


def split_front_matter(text: str) -> tuple[dict[str, Any] | None, str]:
    """``(front matter or None, body)``: the YAML mapping at the top of ``text`` and the text
    after its closing line; ``(None, text)`` when there is none.

    Raises:
        InvalidInput (``invalid_front_matter``): the block is not valid YAML.
        TooLarge (``front_matter_too_large``): more than :data:`MAX_FRONT_MATTER_NODES` values.
    """
    import yaml

    head = _OPEN.match(text)
    if head is None:
        return None, text
    close = _CLOSE.search(text, head.end())
    if close is None:
        return None, text
    block = text[head.end():close.start()]
    try:
        data = yaml.safe_load(block)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 2})" if mark is not None else ""
        raise InvalidInput(f"the front matter is not valid YAML{where}: "
                           f"{getattr(exc, 'problem', None) or exc}", code="invalid_front_matter") from exc
    if data is not None and not isinstance(data, dict):
        return None, text
    body = text[close.end():]
    return _jsonable(data or {}, [0]), body[1:] if body.startswith("\n") else body


def _jsonable(value: Any, count: list[int]) -> Any:
    """``value`` as JSON: dates as ISO-8601, keys as strings, sets as sorted lists, bytes and
    other scalars as strings; raises :class:`TooLarge` past the node limit."""
    count[0] += 1
    if count[0] > MAX_FRONT_MATTER_NODES:
        raise TooLarge(f"the front matter holds more than {MAX_FRONT_MATTER_NODES} values",
                       code="front_matter_too_large", limit=MAX_FRONT_MATTER_NODES)
    if isinstance(value, dict):
        return {str(k): _jsonable(v, count) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v, count) for v in value]
    if isinstance(value, set):
        return sorted(str(v) for v in value)
    if isinstance(value, dt.date | dt.datetime):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def drop_html_comments(text: str) -> str:
    """``text`` without its HTML comments (see the module docstring): fenced code and inline
    code spans are kept verbatim."""
    out: list[str] = []
    fence: str | None = None
    in_comment = False
    for line in text.splitlines(keepends=True):
        if in_comment:
            end = line.find("-->")
            if end < 0:
                continue
            in_comment, line = False, line[end + 3:]
            if not line.strip():
                continue
        elif fence is not None:
            out.append(line)
            m = _FENCE.match(line)
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                    and not line[m.end():].strip():
                fence = None
            continue
        else:
            m = _FENCE.match(line)
            if m:
                fence = m.group(1)
                out.append(line)
                continue
        kept, in_comment = _line_without_comments(line)
        if kept.strip() or not line.strip() or kept == line:
            out.append(kept)  # a line that held only a comment goes with it
    return "".join(out)


def _line_without_comments(line: str) -> tuple[str, bool]:
    """``(line without its comments, a comment opened and not closed on it)``; code spans kept."""
    parts: list[str] = []
    pos = 0
    while True:
        m = _INLINE.search(line, pos)
        if m is None:
            parts.append(line[pos:])
            return "".join(parts), False
        if m.group() == "<!--":
            parts.append(line[pos:m.start()])
            end = line.find("-->", m.end())
            if end < 0:
                tail = "\n" if line.endswith("\n") else ""
                return "".join(parts).rstrip(" \t") + tail, True
            pos = end + 3
            continue
        ticks = m.group()
        close = re.compile(rf"(?<!`){ticks}(?!`)").search(line, m.end())
        stop = close.end() if close else m.end()
        parts.append(line[pos:stop])
        pos = stop


def markdown_text(text: str) -> tuple[str, dict[str, Any] | None]:
    """``(text to index, front matter or None)`` of a Markdown document.

    Raises:
        InvalidInput (``invalid_front_matter``), TooLarge: see :func:`split_front_matter`.
    """
    front, body = split_front_matter(text)
    return drop_html_comments(body), front
