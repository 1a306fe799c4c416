"""The prompt layout: in which order the chosen slots are shown to the model.

Retrieval chooses the slots (the first ``k`` of the candidates' slots, :mod:`app.prompting.slots`); the
layout only orders them. Two layouts (setting ``prompt_layout``):

* ``rank``: best-ranked first, as retrieval returned them.
* ``canonical`` (the default): sorted by a stable key of the chunk itself, ``(document id,
  document version, start offset in the document, chunk sha256)``: documents in id order, each
  document's chunks in reading order.

Why canonical: the local engine reuses any cached prefix of whole token blocks
(docs/engines.md, "The local engine's prefix KV cache"), and a prompt's tokens depend on the
order of its chunks (and each is numbered ``[n]`` by its place). Questions on one topic
retrieve overlapping sets of chunks, but rank the shared ones differently: ``{A, B, C}`` as
``B, A, C`` for one question and ``A, B, D`` for the next share nothing in rank order. Sorted,
they are ``A, B, C`` and ``A, B, D``: the two prompts share the scaffold and ``A, B``. Under
Zipf-repeated topics the popular chunks come back for many questions; with a fixed order
each set of chunks always has the same prompt, and two sets share every chunk up to the first
one only one of them holds. The sort key is the chunk's place in the corpus, so a document's
chunks are also read in their own order. What is given up: the best chunk is no longer
necessarily first. The model still sees the same chunks (the same ``k``, the same slots), and
the answer's citations name each chunk's number in the prompt (``Citation.shown_as``).

The order is recorded in the receipt (``prompt.layout``: the layout and the slots in the order
shown) and replay lays the prompt out from it; a receipt without it showed rank order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

LAYOUTS = ("rank", "canonical")


class Placed(Protocol):
    """What the canonical key reads of a slot (an :class:`app.prompting.prompt.PromptChunk`)."""

    @property
    def document_id(self) -> int | str:
        """The document the slot's text comes from."""
        ...

    @property
    def version(self) -> int:
        """That document's version."""
        ...

    @property
    def start_char(self) -> int:
        """Where the chunk starts in the document's normalised text (characters)."""
        ...

    @property
    def chunk_hash(self) -> str:
        """``sha256:`` of the chunk's text (breaks any remaining tie)."""
        ...


def canonical_key(chunk: Placed) -> tuple[str, int, int, str]:
    """The canonical sort key of a slot: ``(document id as text, version, start offset, chunk hash)``."""
    return (str(chunk.document_id), int(chunk.version), int(chunk.start_char), chunk.chunk_hash)


def layout_order(chunks: Sequence[Placed], layout: str) -> list[int]:
    """The order ``layout`` shows ``chunks`` (slot order) in: 1-based indices into ``chunks``.

    Raises:
        ValueError: ``layout`` is not one of :data:`LAYOUTS` (the setting is checked when loaded).
    """
    if layout == "rank":
        return list(range(1, len(chunks) + 1))
    if layout == "canonical":
        return [i + 1 for i, _c in sorted(enumerate(chunks), key=lambda e: (canonical_key(e[1]), e[0]))]
    raise ValueError(f"unknown prompt layout {layout!r} (one of {', '.join(LAYOUTS)})")


def shown_as(order: list[int]) -> dict[int, int]:
    """``{slot: its number [n] in the prompt}`` for the slots ``order`` shows (1-based both)."""
    return {slot: place for place, slot in enumerate(order, start=1)}
