"""Boilerplate that repeats across the HTML pages of one batch: learned, then dropped at page edges.

Markup rules (``retrieval.extract``) remove chrome that a page marks as such
(semantic tags, ARIA roles). A site header written as a plain ``<div>`` (the
SQLite docs' ``div.nosearch``: "Small. Fast. Reliable. Choose any three." and
its menu) passes them. It is recognised here by repetition instead.

*Blocks.* A page's extracted, normalised text is split at blank lines
(``"\\n\\n"``, the separator ``retrieval.extract`` puts between block
elements); each piece is a block. A block's key is ``sha256:`` of its text with
runs of whitespace collapsed to one space and the ends stripped
(:func:`block_key`). Blank pieces have no key.

*Learning* (:func:`learn_boilerplate`, a pure function of the batch's HTML
pages, independent of their order). With ``n`` HTML pages in the batch, a
block is a candidate when it occurs on at least ``max(MIN_PAGES,
ceil(MIN_SHARE * n))`` of them (5 pages and half the batch). A page's *edge
runs* for a set of keys are its longest prefix and longest suffix of blocks
whose keys are in the set. Starting from the candidates, blocks that lie in an
edge run on fewer pages than the threshold are removed, and this is repeated
until nothing changes (the set only shrinks, so it ends). What is left is
boilerplate: repeated *and* standing at the top or bottom of the pages. A
heading such as "See also", "Note" or "Synopsis" that recurs in the middle of
many pages is therefore never learned.

*Dropping* (:func:`drop_boilerplate`). The edge runs of a page for the
boilerplate keys are removed; blocks in the middle are kept even when their
key is known. A page whose blocks would all be removed is kept whole (its text
is all the page has).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from foundation.hashing import sha256_text
from retrieval.extract import has_visible_content
from retrieval.models import BoilerplateBlock

#: A block must occur on at least this many HTML pages of the batch to be learned.
MIN_PAGES = 5
#: ... and on at least this share of them (rounded up).
MIN_SHARE = 0.5
_SEP = "\n\n"


@dataclass(frozen=True)
class LearnedBlock:
    """A block learned from a batch: its whitespace-collapsed ``text`` and the ``pages`` holding it,
    out of ``batch_pages`` HTML pages."""

    text: str
    pages: int
    batch_pages: int


def block_key(block: str) -> str | None:
    """``sha256:`` of ``block`` with whitespace runs collapsed to one space, or None for a blank block."""
    squeezed = " ".join(block.split())
    return sha256_text(squeezed) if squeezed else None


def split_blocks(text: str) -> list[str]:
    """The blocks of an extracted text: its pieces between blank lines (``"\\n\\n"``), in order."""
    return text.split(_SEP)


def page_threshold(n_pages: int) -> int:
    """Pages a block must occur on to be learned from a batch of ``n_pages`` HTML pages."""
    return max(MIN_PAGES, math.ceil(MIN_SHARE * n_pages))


def _edge_span(keys: Sequence[str | None], known: set[str] | frozenset[str]) -> tuple[int, int]:
    """``(head, tail)``: the first kept index and the end of the kept range (edge runs excluded)."""
    head = 0
    while head < len(keys) and keys[head] in known:
        head += 1
    tail = len(keys)
    while tail > head and keys[tail - 1] in known:
        tail -= 1
    return head, tail


def learn_boilerplate(pages: Iterable[str]) -> dict[str, LearnedBlock]:
    """The boilerplate blocks of one batch's HTML pages (extracted, normalised texts).

    Returns ``{key: LearnedBlock}`` in key order, empty when the batch has
    fewer than :data:`MIN_PAGES` pages. See the module docstring for the rule.
    The result depends on the multiset of page texts only, not on their order.
    """
    page_keys: list[list[str | None]] = []
    texts: dict[str, str] = {}
    count: Counter[str] = Counter()
    for text in pages:
        blocks = split_blocks(text)
        keys = [block_key(b) for b in blocks]
        page_keys.append(keys)
        for b, k in zip(blocks, keys, strict=True):
            if k is not None:
                texts.setdefault(k, " ".join(b.split()))
        count.update({k for k in keys if k is not None})
    need = page_threshold(len(page_keys))
    if len(page_keys) < MIN_PAGES:
        return {}
    learned = {k for k, c in count.items() if c >= need}
    while learned:
        at_edge: Counter[str] = Counter()
        for keys in page_keys:
            head, tail = _edge_span(keys, learned)
            at_edge.update({k for k in keys[:head] + keys[tail:] if k is not None})
        kept = {k for k in learned if at_edge[k] >= need}
        if kept == learned:
            break
        learned = kept
    return {k: LearnedBlock(texts[k], count[k], len(page_keys)) for k in sorted(learned)}


def drop_boilerplate(text: str, known: set[str] | frozenset[str]) -> tuple[str, set[str]]:
    """``text`` without its leading and trailing blocks whose keys are in ``known``.

    Returns ``(text, keys removed)``. The text is unchanged (and no key reported)
    when no edge block is known or when every block is.
    """
    if not known:
        return text, set()
    blocks = split_blocks(text)
    keys = [block_key(b) for b in blocks]
    head, tail = _edge_span(keys, known)
    if head == 0 and tail == len(blocks):
        return text, set()
    kept = _SEP.join(blocks[head:tail]).strip("\n")
    if not has_visible_content(kept):
        return text, set()
    return kept, {k for k in keys[:head] + keys[tail:] if k is not None}


def stored_boilerplate(session: Session) -> frozenset[str]:
    """The keys of every block learned by an earlier batch (table ``boilerplate_blocks``)."""
    return frozenset(str(k) for k in session.scalars(select(BoilerplateBlock.block_hash)))
