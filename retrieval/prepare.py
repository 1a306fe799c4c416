"""The prepare phase of an ingest batch: validate, extract, normalise, hash and chunk, outside any lock.

This is the slow part of a batch (extraction and chunking are CPU-bound), so it
runs before the write transaction (``retrieval.commit``). Boilerplate blocks
repeated across the batch's HTML pages are learned and dropped here
(``retrieval.boilerplate``). For each item it produces a :class:`Prepared`
(the extracted text, its ``sha256:`` content hash, the source bytes' hash,
the metadata JSON, and the chunks when the text differs from the live version
read beforehand), or an ``ItemResult`` rejection with a
code and reason; one bad item never stops the others.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from foundation.errors import InvalidInput, RagBudgetError, TooLarge
from foundation.hashing import canonical_json, sha256_bytes, sha256_text
from retrieval.boilerplate import LearnedBlock, drop_boilerplate, learn_boilerplate
from retrieval.chunking import ChunkerConfig, ChunkSpan, chunk_text
from retrieval.document_ids import check_document_id, lookup_document_id, printable
from retrieval.extract import check_kind, check_text, extract
from retrieval.revisions import CurrentRow
from retrieval.tokens import TextTokenizer


@dataclass
class IngestItem:
    """One document to ingest: ``text`` (already decoded) or ``raw`` bytes of ``kind``."""

    document_id: str
    text: str | None = None
    raw: bytes | None = None
    kind: str = "txt"
    metadata: dict[str, Any] = field(default_factory=dict)
    source_path: str | None = None


@dataclass
class ItemResult:
    """The outcome for one item or deletion; ``code`` and ``reason`` are set when rejected."""

    document_id: str
    status: str
    version: int | None = None
    reason: str | None = None
    code: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


@dataclass
class Prepared:
    """One item ready to commit: position ``index`` in the batch, extracted ``text`` and its hashes,
    the metadata JSON, and ``chunks`` (None while the pre-read said the text is unchanged)."""

    index: int
    document_id: str
    text: str
    content_hash: str
    source_hash: str
    metadata_json: str
    chunks: list[ChunkSpan] | None = None


def prepare_item(item: IngestItem, max_document_bytes: int) -> tuple[str, str, str, dict[str, Any] | None]:
    """Validate and extract one item; return ``(text, content_hash, source_hash, front_matter)``.

    The source hash is ``sha256:`` of ``raw``, or of the UTF-8 bytes of ``text`` as given.
    ``front_matter``: a Markdown item's YAML front matter (:mod:`retrieval.markdown`), else None.

    Raises:
        InvalidInput and subclasses: bad id, kind, encoding, size, front matter, or no visible
            content.
    """
    check_document_id(item.document_id)
    kind = check_kind(item.kind)
    if (item.text is None) == (item.raw is None):
        raise InvalidInput("give exactly one of text or raw")
    source = item.raw if item.raw is not None else check_text(str(item.text)).encode("utf-8")
    if len(source) > max_document_bytes:
        raise TooLarge(f"document is {len(source)} bytes; the limit is {max_document_bytes}",
                       size_bytes=len(source), limit_bytes=max_document_bytes)
    got = extract(kind, raw=item.raw) if item.raw is not None else extract(kind, text=str(item.text))
    return got.text, sha256_text(got.text), sha256_bytes(source), got.front_matter


def metadata_json(item: IngestItem, size_bytes: int, source_hash: str,
                  front_matter: dict[str, Any] | None = None) -> str:
    """Canonical JSON ``{"user": <item.metadata>, "source": {kind, path, bytes, sha256}}``, with
    ``"front_matter"`` (a Markdown document's YAML front matter, :mod:`retrieval.markdown`) when
    the document has one.

    Raises:
        InvalidInput: metadata is not a JSON object with string keys.
    """
    if not isinstance(item.metadata, dict) or not all(isinstance(k, str) for k in item.metadata):
        raise InvalidInput("metadata must be a JSON object with string keys")
    source = {"kind": item.kind, "path": item.source_path, "bytes": size_bytes, "sha256": source_hash}
    out: dict[str, Any] = {"user": item.metadata, "source": source}
    if front_matter is not None:
        out["front_matter"] = front_matter
    return canonical_json(out).decode("utf-8")


def rejected(document_id: object, exc: RagBudgetError) -> ItemResult:
    """The ``rejected`` result for ``document_id`` with the error's code and message."""
    return ItemResult(str(document_id), "rejected", reason=exc.message, code=exc.code)


def split_batch(items: Sequence[IngestItem], delete_ids: Sequence[str]
                ) -> tuple[list[tuple[int, IngestItem]], list[str], dict[int, ItemResult]]:
    """``(candidates, deletes, results)``: items and deletions to process, and the rejections of
    ids that break the grammar (``retrieval.document_ids``) or are given twice (an id repeated
    among the items, or both ingested and deleted). Ids are NFC-normalised here: the candidates
    carry the normalised id, and deletions are looked up by it (without the grammar, so an id
    stored before a rule existed can still be deleted).

    Positions: item ``i`` is ``i``; deletion ``k`` is ``len(items) + k``.
    """
    results: dict[int, ItemResult] = {}
    seen: set[str] = set()
    candidates: list[tuple[int, IngestItem]] = []
    for idx, item in enumerate(items):
        try:
            item = replace(item, document_id=check_document_id(item.document_id))
        except InvalidInput as exc:
            results[idx] = rejected(printable(str(item.document_id)), exc)
            continue
        if item.document_id in seen:
            results[idx] = rejected(item.document_id, InvalidInput("duplicate document id in batch"))
            continue
        seen.add(item.document_id)
        candidates.append((idx, item))
    deletes: list[str] = []
    for k, did in enumerate(delete_ids):
        try:
            did = lookup_document_id(did)
        except InvalidInput as exc:
            results[len(items) + k] = rejected(printable(str(did)), exc)
            continue
        if did in seen:
            results[len(items) + k] = rejected(did, InvalidInput("document id is both ingested and "
                                                                 "deleted in one batch"))
            continue
        seen.add(did)
        deletes.append(did)
    return candidates, deletes, results


def prepare_items(candidates: Sequence[tuple[int, IngestItem]], before: dict[str, CurrentRow], *,
                  tokenizer: TextTokenizer, chunker_config: ChunkerConfig, max_document_bytes: int,
                  embed_token_count: Callable[[str], int] | None, results: dict[int, ItemResult],
                  progress: bool | Callable[[int, int], None] = False,
                  known_boilerplate: frozenset[str] = frozenset(),
                  ) -> tuple[list[Prepared], dict[str, LearnedBlock]]:
    """Prepare every candidate; rejections go into ``results`` at the item's position.

    Returns ``(prepared, new_boilerplate)``. Every candidate is extracted first;
    then the boilerplate of the batch's HTML items is learned
    (``retrieval.boilerplate.learn_boilerplate``) and, together with
    ``known_boilerplate`` (the keys stored by earlier batches), dropped from the
    edges of each HTML item's text. ``new_boilerplate`` holds the learned blocks
    not yet known that were dropped from at least one item, for the commit to store.

    An item is chunked only when ``before`` (the newest row per id, read without
    the lock) says its content hash is new; the commit re-checks under the lock.
    """
    step = progress_bar(progress, len(candidates))
    done = 0
    extracted: list[tuple[int, IngestItem, str, str, str]] = []
    for idx, item in candidates:
        try:
            text, _, shash, front = prepare_item(item, max_document_bytes)
            size = len(item.raw) if item.raw is not None else len(str(item.text).encode("utf-8"))
            extracted.append((idx, item, text, shash, metadata_json(item, size, shash, front)))
        except InvalidInput as exc:
            results[idx] = rejected(item.document_id, exc)
            done += 1
            step(done)
    learned = learn_boilerplate(text for _, item, text, _, _ in extracted if item.kind == "html")
    known = known_boilerplate | frozenset(learned)
    used: set[str] = set()
    prepared: list[Prepared] = []
    for idx, item, text, shash, meta in extracted:
        if item.kind == "html":
            text, removed = drop_boilerplate(text, known)
            used |= removed
        chash = sha256_text(text)
        p = Prepared(idx, item.document_id, text, chash, shash, meta)
        cur = before.get(item.document_id)
        if cur is None or cur.is_tombstone or cur.content_hash != chash:
            p.chunks = chunk_text(text, tokenizer, chunker_config, embed_token_count)
        prepared.append(p)
        done += 1
        step(done)
    new = {k: b for k, b in learned.items() if k in used and k not in known_boilerplate}
    return prepared, new


def chunk_pairs(prepared: Iterable[Prepared]) -> list[tuple[str, str]]:
    """Distinct ``(chunk_hash, text)`` of the prepared items' chunks, first occurrence order."""
    pairs: dict[str, str] = {}
    for p in prepared:
        for c in p.chunks or ():
            pairs.setdefault(c.chunk_hash, c.text)
    return list(pairs.items())


def progress_bar(progress: bool | Callable[[int, int], None], total: int) -> Callable[[int], None]:
    """A step function for ``progress``: tqdm on stderr (True), a callback ``(done, total)``, or nothing."""
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="doc", file=sys.stderr, desc="ingest", leave=False)

        def step(done: int) -> None:
            bar.update(1)
            if done >= total:
                bar.close()

        return step
    if callable(progress):
        cb = progress
        return lambda done: cb(done, total)
    return lambda done: None
