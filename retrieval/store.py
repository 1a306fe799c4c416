"""Ingesting into the versioned, content-hashed store: one batch, one transaction, one revision.

A batch runs in two phases:

1. *Prepare* (``retrieval.prepare``, no write lock held): validate and extract
   every item, normalise the text, drop the boilerplate repeated across the
   batch's HTML pages or learned by earlier batches (``retrieval.boilerplate``),
   hash it, chunk it when it differs from the live version, and compute missing
   embeddings. This is the slow part.
2. *Commit* (``retrieval.commit``, inside ``foundation.db.write_transaction``,
   serialised across processes): re-read the head, diff against it, and insert
   documents, versions, tombstones, chunks, embeddings and the new ``Revision``
   row. Everything commits together or nothing does; a batch that changes
   nothing creates no revision.

This module is the store's front door: :func:`ingest_batch` runs the two
phases, and the types and functions callers need are re-exported here (the
read side from ``retrieval.revisions``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Engine

from foundation.db import WriterLock, read_session, write_transaction
from retrieval.boilerplate import stored_boilerplate
from retrieval.chunking import ChunkerConfig, chunker_id
from retrieval.commit import (  # noqa: F401  (re-exported API)
    PAUSE_ENV,
    PAUSE_MARKER_ENV,
    STATUSES,
    IngestReport,
    commit_batch,
)
from retrieval.document_ids import (  # noqa: F401  (re-exported API)
    MAX_DOCUMENT_ID_BYTES,
    check_document_id,
    normalize_document_id,
)
from retrieval.prepare import (  # noqa: F401  (re-exported API)
    IngestItem,
    ItemResult,
    chunk_pairs,
    prepare_item,
    prepare_items,
    split_batch,
)
from retrieval.revisions import (  # noqa: F401  (re-exported API)
    DocumentInfo,
    LiveVersion,
    RevisionInfo,
    VersionInfo,
    current_rows,
    get_document,
    get_revision,
    get_version,
    latest_revision,
    list_chunks,
    list_revisions,
    list_versions,
    recompute_root,
    root_hash,
    state_at,
    verify_store,
)
from retrieval.tokens import TextTokenizer


def ingest_batch(
    engine: Engine,
    items: Sequence[IngestItem],
    *,
    tokenizer: TextTokenizer,
    chunker_config: ChunkerConfig,
    embedder: Any = None,
    delete_ids: Sequence[str] = (),
    note: str | None = None,
    progress: bool | Callable[[int, int], None] = False,
    max_document_bytes: int = 20 * 2**20,
    embed_token_count: Callable[[str], int] | None = None,
) -> IngestReport:
    """Ingest ``items`` and delete ``delete_ids`` as one batch: one transaction, at most one revision.

    HTML items lose the boilerplate blocks at their edges that repeat across the
    batch's HTML pages or that an earlier batch learned (``retrieval.boilerplate``);
    the blocks this batch learns are stored with it (table ``boilerplate_blocks``).

    Per item: ``added`` (new id, or re-added after deletion), ``updated`` (content
    hash differs from the live version: version n+1), ``unchanged`` (same content
    hash: nothing written), or ``rejected`` with ``code``/``reason`` (bad input;
    nothing written for it, the rest of the batch proceeds). Per deletion:
    ``deleted`` (a tombstone) or ``rejected`` (``unknown_document``: not live).

    ``embed_token_count`` (word-pieces incl. [CLS]/[SEP]; default: the embedder's
    ``count_wordpieces``) keeps every chunk within ``chunker_config.max_embed_tokens``.
    With ``embedder``, vectors of new chunk hashes are computed before the
    transaction (``retrieval.embedding``). ``timings_ms`` of the report splits
    ``prepare_ms``, ``embed_ms``, ``commit_ms`` and ``total_ms`` (wall clock).

    Raises:
        sqlalchemy errors from the database (the batch is then rolled back entirely).
    """
    t0 = time.perf_counter()
    candidates, deletes, results = split_batch(items, delete_ids)
    if embed_token_count is None and embedder is not None:
        embed_token_count = getattr(embedder, "count_wordpieces", None)
    with read_session(engine) as s:
        before = current_rows(s, (it.document_id for _, it in candidates if isinstance(it.document_id, str)))
        known_boilerplate = stored_boilerplate(s)
    prepared, boilerplate = prepare_items(
        candidates, before, tokenizer=tokenizer, chunker_config=chunker_config,
        max_document_bytes=max_document_bytes, embed_token_count=embed_token_count, results=results,
        progress=progress, known_boilerplate=known_boilerplate)
    t_prepared = time.perf_counter()

    vectors: dict[str, Any] = {}
    if embedder is not None:
        from retrieval.embedding import compute_missing

        pairs = chunk_pairs(prepared)
        if pairs:
            with read_session(engine) as s:
                vectors = compute_missing(s, embedder, pairs, progress=bool(progress))
    t_embedded = time.perf_counter()

    with write_transaction(engine, WriterLock.CORPUS) as session:
        report = commit_batch(session, prepared, deletes, results, len(items),
                              cid=chunker_id(chunker_config, tokenizer.tokenizer_id), tokenizer=tokenizer,
                              chunker_config=chunker_config, embed_token_count=embed_token_count,
                              embedder=embedder, vectors=vectors, note=note, boilerplate=boilerplate)
    t_done = time.perf_counter()
    report.timings_ms = {"prepare_ms": (t_prepared - t0) * 1e3, "embed_ms": (t_embedded - t_prepared) * 1e3,
                         "commit_ms": (t_done - t_embedded) * 1e3, "total_ms": (t_done - t0) * 1e3}
    return report
