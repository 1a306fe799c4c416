"""The ingest service: files or API documents -> one store batch (at most one new revision).

Beside the answer pipeline (``app.answering.pipeline``), this is the one place where the
ingest wiring is decided: which extraction a file gets (by suffix), the chunker
configuration (``chunk_tokens`` / ``chunk_overlap_tokens`` from the settings,
the generator's tokenizer, the embedder's word-piece limit), whether and with
which embedder new chunks are embedded, the batch-size limit, and how files
under a directory become document ids. The API (``/v1/documents``), the CLI
(``ragbudget ingest``, ``ragbudget demo``) and the benchmarks all call
:class:`IngestService`; none of them builds a ``ChunkerConfig`` or calls
``retrieval.store.ingest_batch`` itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.services import Services
from foundation.errors import InvalidInput, RagBudgetError, TooLarge
from retrieval.chunking import ChunkerConfig
from retrieval.corpus import FetchResult
from retrieval.document_ids import check_document_id, printable
from retrieval.folders import FolderWalk
from retrieval.store import IngestItem, IngestReport, ItemResult

#: Where the shipped ``.deb`` files of the real corpus are looked for first
#: (``../shared/corpora`` next to the repository, or ``$RAGBUDGET_SHARED_DIR/corpora``).
SHARED_CORPORA = Path(os.environ.get("RAGBUDGET_SHARED_DIR")
                      or Path(__file__).resolve().parents[2] / "shared").expanduser() / "corpora"


@dataclass
class IngestOutcome:
    """A batch's :class:`~retrieval.store.IngestReport` plus notes for the operator.

    ``notes`` says what was left out on purpose (embeddings skipped or unavailable).
    """

    report: IngestReport
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The report's JSON form (``IngestReport.to_dict``) with ``notes`` when there are any."""
        out = self.report.to_dict()
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def collect_files(paths: Sequence[Path], max_bytes: int, document_id: str | None = None, *,
                  follow_symlinks: bool = False) -> tuple[list[IngestItem], list[ItemResult]]:
    """Files under ``paths`` as ``IngestItem``s, plus ``ItemResult``s for the paths not taken.

    A directory is its own ingest root (ids are paths relative to it, ``/``-separated,
    NFC-normalised; hidden files and directories are skipped), walked by
    :class:`retrieval.folders.FolderWalk`: each real file is read once, whatever number of
    symbolic or hard links reach it, and a symbolic link loop is never followed. A file's
    root is its parent, so its id is its name, or ``document_id`` when given (one file only).

    ``skipped`` (nothing wrong with it, it is covered already): ``symlink_loop``,
    ``duplicate_directory``, ``duplicate_file``, ``symlink_not_followed``. ``rejected``, each
    on its own, the other files still returned: an id that breaks the grammar
    (``invalid_document_id``, e.g. a name that is not valid UTF-8), over ``max_bytes``
    (``too_large``), an unsupported suffix (``unsupported_type``), unreadable
    (``unreadable``), a missing path (``not_found``), a path that is neither a regular file
    nor a directory (``not_regular_file``, e.g. ``/dev/zero``), a dangling symbolic link
    (``broken_symlink``) and, inside a directory, a symbolic link whose target is outside it
    (``symlink_outside``; followed only with ``follow_symlinks``). Ids and paths in results
    are shown with :func:`retrieval.document_ids.printable`.

    Raises:
        InvalidInput: ``document_id`` given with anything but exactly one file path.
        InvalidDocumentId: ``document_id`` breaks the id grammar (an empty id included).
    """
    from retrieval.extract import kind_for_suffix

    if document_id is not None:
        document_id = check_document_id(document_id)
        if len(paths) != 1 or not paths[0].is_file():
            raise InvalidInput("--id needs exactly one regular file path")
    found: list[tuple[str, Path]] = []
    rejected: list[ItemResult] = []
    walker = FolderWalk(follow_symlinks)
    for root in paths:
        if root.is_dir():
            files, passed = walker.walk(root)
            found.extend(files)
            for x in passed:
                rejected.append(ItemResult(printable(x.rel), x.status, reason=f"{x.reason}: "
                                           f"{printable(str(x.path))}", code=x.code))
        elif root.is_file():
            found.append((document_id or root.name, root))
        elif root.exists():
            shown = printable(str(root))
            rejected.append(ItemResult(shown, "rejected", reason=f"not a regular file: {shown}",
                                       code="not_regular_file"))
        else:
            shown = printable(str(root))
            rejected.append(ItemResult(shown, "rejected", reason=f"no such file or directory: {shown}",
                                       code="not_found"))
    items = []
    for raw_id, f in found:
        doc_id = printable(raw_id)
        try:
            doc_id = check_document_id(raw_id)
            kind = kind_for_suffix(f.name)
            size = f.stat().st_size
            if size > max_bytes:
                raise TooLarge(f"{size} bytes; the limit is {max_bytes}")
            items.append(IngestItem(doc_id, raw=f.read_bytes(), kind=kind, source_path=printable(str(f))))
        except RagBudgetError as exc:
            rejected.append(ItemResult(doc_id, "rejected", reason=exc.message, code=exc.code))
        except OSError as exc:
            rejected.append(ItemResult(doc_id, "rejected", reason=f"cannot read {printable(str(f))}: "
                                       f"{exc.strerror}", code="unreadable"))
    return items, rejected


class IngestService:
    """Ingest documents into the store of one :class:`~app.services.Services`.

    Models load through ``services`` (the generator's tokenizer for chunking, the
    embedder for vectors), once per process.
    """

    def __init__(self, services: Services) -> None:
        self.services = services

    @property
    def settings(self) -> Any:
        """The settings in force (``app.settings.Settings``)."""
        return self.services.settings

    def chunker_config(self) -> ChunkerConfig:
        """The chunk window in generator tokens from the settings.

        Raises:
            InvalidConfig: the overlap is not smaller than the window.
        """
        return ChunkerConfig(self.settings.chunk_tokens, self.settings.chunk_overlap_tokens)

    def embedder(self, embed: bool = True) -> tuple[Any, str | None]:
        """``(embedder or None, note)``: the configured embedder, or None with the reason why not.

        None when ``embed`` is false (store and chunk only; a later ingest or the
        retriever's sync embeds) or when ``retrieval.embedding``'s dependencies
        (sentence-transformers) are not installed.
        """
        if not embed:
            return None, "embeddings skipped (--no-embed)"
        try:
            import retrieval.embedding  # noqa: F401
        except ImportError:
            return None, "retrieval.embedding is not available: ingesting without embeddings"
        return self.services.embedder, None

    def _word_pieces(self) -> Callable[[str], int]:
        """The embedder tokenizer's word-piece counter, for chunk limits without loading the model."""
        from retrieval.chunking import wordpiece_counter
        from retrieval.embedding import packaged_embedder_path

        return wordpiece_counter(self.settings.embedder_path or packaged_embedder_path())

    def collect(self, paths: Sequence[Path], document_id: str | None = None, *,
                follow_symlinks: bool = False) -> tuple[list[IngestItem], list[ItemResult]]:
        """:func:`collect_files` with the settings' ``max_document_bytes``."""
        return collect_files(paths, self.settings.max_document_bytes, document_id,
                             follow_symlinks=follow_symlinks)

    def ingest(self, items: Sequence[IngestItem], *, delete_ids: Sequence[str] = (), embed: bool = True,
               note: str | None = None, progress: bool | Callable[[int, int], None] = False,
               rejected: Sequence[ItemResult] = (), max_documents: int | None = None) -> IngestOutcome:
        """Ingest ``items`` and tombstone ``delete_ids`` as one batch (one transaction, at most one
        revision); ``rejected`` (paths refused or skipped before reading, e.g. by
        :meth:`collect`) is appended to the report's results so the caller sees the whole batch.

        Raises:
            TooLarge (``too_many_documents``): more than ``max_documents`` items plus deletions.
            InvalidConfig: bad chunk window settings.
            sqlalchemy errors from the database (the batch is rolled back entirely).
        """
        from retrieval.store import ingest_batch

        n = len(items) + len(delete_ids)
        if max_documents is not None and n > max_documents:
            raise TooLarge(f"{n} documents in one batch; the limit is {max_documents}",
                           code="too_many_documents", limit=max_documents)
        config = self.chunker_config()
        embedder, why = self.embedder(embed)
        report = ingest_batch(
            self.services.engine, items, tokenizer=self.services.tokenizer, chunker_config=config,
            embedder=embedder, delete_ids=delete_ids, note=note, progress=progress,
            max_document_bytes=self.settings.max_document_bytes,
            embed_token_count=None if embedder is not None else self._word_pieces())
        report.results.extend(rejected)
        return IngestOutcome(report, [why] if why else [])

    def ingest_paths(self, paths: Sequence[Path], *, document_id: str | None = None,
                     delete_missing: bool = False, embed: bool = True, note: str | None = None,
                     progress: bool | Callable[[int, int], None] = False,
                     follow_symlinks: bool = False) -> IngestOutcome:
        """Ingest the files under ``paths`` (see :func:`collect_files`) as one batch.

        With ``delete_missing``, live documents whose ids were not found under
        ``paths`` (neither ingested nor rejected; a skipped path, e.g. a second link to a
        file, counts as not found) are tombstoned in the same batch.

        Raises:
            InvalidInput: ``document_id`` with anything but one file path.
            InvalidConfig: bad chunk window settings (checked before any file is read).
        """
        self.chunker_config()
        items, rejected = self.collect(paths, document_id, follow_symlinks=follow_symlinks)
        delete_ids: list[str] = []
        if delete_missing:
            from foundation.db import read_session
            from retrieval.store import latest_revision, state_at

            # a path rejected now (unreadable for a moment) keeps its document; a skipped one is
            # covered by another path (a loop, a second link to a file), so it is no document
            present = ({it.document_id for it in items}
                       | {r.document_id for r in rejected if r.status == "rejected"})
            with read_session(self.services.engine) as s:
                delete_ids = [v.document_id for v in state_at(s, latest_revision(s))
                              if v.document_id not in present]
        return self.ingest(items, delete_ids=delete_ids, embed=embed, note=note, progress=progress,
                           rejected=rejected)

    def fetch_postgres_docs(self, version: str, deb: Path | None = None) -> FetchResult:
        """Unpack the PostgreSQL docs ``version`` into ``<data_dir>/corpora/`` (see
        ``retrieval.corpus.fetch_postgres_docs``), looking in :data:`SHARED_CORPORA` first.

        Raises:
            InvalidInput: an unsupported version. NotFound (``corpus_unavailable``): no package.
        """
        from retrieval.corpus import fetch_postgres_docs

        return fetch_postgres_docs(self.services.data_dir, version, deb=deb, search_dirs=[SHARED_CORPORA])
