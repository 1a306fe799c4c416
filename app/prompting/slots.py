"""Prompt slots: one place in the prompt per distinct chunk text, citing every source that has it.

The same text often sits under several document ids: a page copied into two
folders, a file linked into the tree twice, a section every release repeats.
Each copy is its own retrieval hit with the same chunk hash (``sha256:`` of the
normalised text, so equal hashes mean equal texts), and laid out one per hit
they filled most of a prompt with one chunk: k places paid in prefill, one
piece of context.

The rule (:func:`slot_numbers`): over the K candidates in rank order, a
candidate whose chunk hash appeared at a better rank joins that candidate's
slot; any other opens the next slot. Slot ``n`` is shown once, as ``[n]``, with
its best-ranked source, and names the others after ``also``
(:meth:`app.prompting.prompt.PromptBuilder.chunk_segment`)::

    [1] (doc guides/setup.md v1; also doc copy/setup.md v1)

The planner's k counts slots, so the place a copy would have taken goes to the
next distinct chunk. The receipt records each candidate's slot
(``candidates[].slot``); replay lays the prompt out from the recorded slots, and
a receipt written before slots existed (no ``slot``) from one slot per
candidate, as its prompt was (:func:`receipts.schema.candidate_slots`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.prompting.prompt import PromptChunk


def slot_numbers(chunk_hashes: Sequence[str]) -> list[int]:
    """1-based slot of each candidate (rank order): candidates with one chunk hash share the slot
    the best-ranked of them opened; slots open in rank order (1, 2, ... with no gap)."""
    opened: dict[str, int] = {}
    return [opened.setdefault(h, len(opened) + 1) for h in chunk_hashes]


def hit_slots(hits: Sequence[Any]) -> list[int]:
    """:func:`slot_numbers` of retrieval hits (anything with a ``chunk_hash``)."""
    return slot_numbers([_get(h, "chunk_hash") for h in hits])


def prompt_slots(hits: Sequence[Any], slots: Sequence[int] | None = None) -> list[PromptChunk]:
    """One :class:`PromptChunk` per slot, in slot order: the text and label of the slot's first
    hit, ``also`` the ``(document id, version)`` of the others in rank order.

    ``hits`` have ``document_id``, ``version``, ``text`` and ``chunk_hash`` (retrieval hits,
    :class:`receipts.stored.StoredHit`, or dicts); ``slots`` (default :func:`hit_slots`) gives
    each hit's slot, as a receipt recorded it.

    Raises:
        ValueError: ``slots`` does not have one entry per hit, or skips a slot number.
    """
    numbers = list(slots) if slots is not None else hit_slots(hits)
    if len(numbers) != len(hits):
        raise ValueError(f"{len(numbers)} slots for {len(hits)} hits")
    first: dict[int, Any] = {}
    also: dict[int, list[tuple[Any, int]]] = {}
    for hit, n in zip(hits, numbers, strict=True):
        if n in first:
            also[n].append((_get(hit, "document_id"), int(_get(hit, "version"))))
        else:
            first[n], also[n] = hit, []
    if sorted(first) != list(range(1, len(first) + 1)):
        raise ValueError(f"slots must be numbered 1..n without a gap, got {sorted(first)}")
    return [PromptChunk(document_id=_get(first[n], "document_id"), version=int(_get(first[n], "version")),
                        text=_get(first[n], "text"), also=tuple(also[n]),
                        start_char=int(_opt(first[n], "start_char", 0)),
                        chunk_hash=str(_opt(first[n], "chunk_hash", "")))
            for n in range(1, len(first) + 1)]


def in_first_slots(hits: Sequence[Any], k: int, slots: Sequence[int] | None = None) -> list[Any]:
    """The hits shown in a prompt of ``k`` slots (slot <= k), in rank order."""
    numbers = list(slots) if slots is not None else hit_slots(hits)
    return [h for h, n in zip(hits, numbers, strict=True) if n <= k]


def _get(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


def _opt(obj: Any, name: str, default: Any) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)
