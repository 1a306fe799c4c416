"""The receipt spool: a finished answer's receipt outlives a database outage.

When the chain append of a finished answer fails because the database cannot be reached
(a failover, a restart, a dropped connection), the receipt's content, everything the
append needs apart from the chain link, is written to the data directory
(:meth:`ReceiptSpool.put`): one file per receipt, ``<receipt id>.json``, written to a
temporary name, ``fsync``'d, renamed into place and the directory ``fsync``'d, so a file is
either wholly there or absent, also across a power cut. The file is the RFC 8785 canonical
JSON (:func:`foundation.hashing.jcs_canonical`) of ``{"spool_format": 1, "receipt_id",
"created_at", "content", "record_hash"}``; ``record_hash`` is ``sha256:`` over the canonical
bytes of the record without it, so a torn or edited file is detected and set aside, never
appended.

:meth:`ReceiptSpool.drain` appends every spooled receipt, oldest ``created_at`` first, each
in one write transaction under the receipts lock (:func:`append_spooled`): appended exactly
once, idempotent by receipt id. A receipt whose id is already in the chain (the first append
committed before its connection dropped, or another process drained the same file) is not
written again; its file is removed. :class:`SpoolDrainer` drains in a background thread with
exponential backoff (0.5 s doubling to 30 s) until the spool is empty; the API's start drains
before the journal's interrupted-sweep (:func:`app.answering.receipt_wiring.record_interrupted_answers`).

Ordering rule: the chain records append order (``seq``, ``prev_hash``); a spooled receipt
keeps the ``created_at`` of the moment its answer ended and its first append failed, so its
``created_at`` may be earlier than its predecessor's in the chain. ``receipts verify`` checks
links and hashes, never the order of ``created_at``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, delete, select

from foundation.bounds import parse_utc_time
from foundation.db import WriterLock, write_transaction
from foundation.errors import InvalidInput, RagBudgetError
from foundation.hashing import jcs_canonical, sha256_bytes
from foundation.provenance import to_utc_iso
from receipts.chain import StoredReceipt, append_in_transaction
from receipts.models import ReceiptJournalRow, ReceiptRow
from receipts.schema import CHAIN_FIELDS, validate_body

log = logging.getLogger("ragbudget.receipts")

SPOOL_FORMAT = 1
#: The spool's folder under the data directory.
SPOOL_DIRNAME = "receipt-spool"
#: Where files that cannot be appended are set aside for an operator (unreadable, or their id
#: already taken in the chain by a different receipt), under the spool's folder.
SET_ASIDE_DIRNAME = "set-aside"


@dataclass(frozen=True)
class SpoolEntry:
    """One spooled receipt: its reserved id, its content (a validated body without chain
    fields) and the ``created_at`` it will carry (ISO-8601 UTC, µs)."""

    receipt_id: str
    created_at: str
    content: dict[str, Any]
    path: Path


@dataclass
class DrainReport:
    """What one :meth:`ReceiptSpool.drain` pass did: receipt ids ``appended`` now, ids found
    ``already`` in the chain (not written again), ids ``set_aside``, how many are ``left``, and
    the ``error`` that stopped the pass (None when it ran to the end)."""

    appended: list[StoredReceipt] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)
    left: int = 0
    error: str | None = None


def content_of(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without its chain fields (what a spool file holds and the append completes)."""
    return {k: v for k, v in body.items() if k not in CHAIN_FIELDS}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ReceiptSpool:
    """The spool folder ``directory`` (created on the first :meth:`put`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._lock = threading.Lock()  # one drain pass at a time in this process

    def path_of(self, receipt_id: str) -> Path:
        """The file of ``receipt_id`` (ids are ``rcpt_<hex>``; anything else is refused).

        Raises:
            InvalidInput: an id that is not a plain file name.
        """
        if not receipt_id or "/" in receipt_id or "\\" in receipt_id or receipt_id.startswith("."):
            raise InvalidInput(f"not a spoolable receipt id: {receipt_id!r}", field="receipt_id")
        return self.directory / f"{receipt_id}.json"

    def put(self, receipt_id: str, body: dict[str, Any], created_at: str) -> Path:
        """Spool ``body`` (a receipt body; its chain fields are dropped) as ``receipt_id``,
        durably: temporary file, ``fsync``, rename, ``fsync`` of the folder. Returns the path.

        Raises:
            InvalidInput: the body does not validate, or the id is not a plain file name.
            OSError: the file cannot be written (disk full, read-only); nothing is left behind.
        """
        content = content_of(body)
        validate_body(content)
        record: dict[str, Any] = {"spool_format": SPOOL_FORMAT, "receipt_id": receipt_id,
                                  "created_at": created_at, "content": content}
        record["record_hash"] = sha256_bytes(jcs_canonical(record))
        data = jcs_canonical(record)
        path = self.path_of(receipt_id)
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{receipt_id}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(self.directory)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    def ids(self) -> set[str]:
        """The receipt ids spooled now (files present; readable or not)."""
        if not self.directory.is_dir():
            return set()
        return {p.stem for p in self.directory.glob("*.json")}

    def entries(self) -> list[SpoolEntry]:
        """Every readable spooled receipt, oldest ``created_at`` first (then id). A file that
        does not read back whole (not JSON, wrong format, record hash differs) is moved to
        ``set-aside/`` and logged."""
        out: list[SpoolEntry] = []
        for path in sorted(self.directory.glob("*.json")) if self.directory.is_dir() else []:
            try:
                entry = _read(path)
            except FileNotFoundError:
                continue  # drained by another process meanwhile
            except (OSError, ValueError, RagBudgetError) as exc:
                log.error("spooled receipt %s is unreadable (%s); set aside", path.name, exc)
                self._set_aside(path)
                continue
            out.append(entry)
        out.sort(key=lambda e: (e.created_at, e.receipt_id))
        return out

    def drain(self, engine: Engine) -> DrainReport:
        """Append every spooled receipt to the chain (:func:`append_spooled`), oldest first,
        removing each file once its receipt is in the chain. Stops at the first database
        error (the rest wait for the next pass); never raises for one.
        """
        report = DrainReport()
        with self._lock:
            entries = self.entries()
            for i, entry in enumerate(entries):
                try:
                    stored, fresh = append_spooled(engine, entry)
                except InvalidInput as exc:
                    log.error("spooled receipt %s no longer validates (%s); set aside",
                              entry.receipt_id, exc)
                    self._set_aside(entry.path)
                    report.set_aside.append(entry.receipt_id)
                    continue
                except Exception as exc:  # the database is still away: try again later
                    report.error = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                    report.left = len(entries) - i
                    return report
                if stored is None:
                    log.error("receipt id %s is already in the chain with another status; the "
                              "spooled receipt is set aside", entry.receipt_id)
                    self._set_aside(entry.path)
                    report.set_aside.append(entry.receipt_id)
                    continue
                if fresh:
                    report.appended.append(stored)
                    log.warning("spooled receipt %s appended at seq %d", stored.id, stored.seq)
                else:
                    report.already.append(entry.receipt_id)
                entry.path.unlink(missing_ok=True)
                _fsync_dir(self.directory)
        return report

    def _set_aside(self, path: Path) -> None:
        aside = self.directory / SET_ASIDE_DIRNAME
        aside.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # drained or set aside by another process
            os.replace(path, aside / path.name)


def _read(path: Path) -> SpoolEntry:
    """Read and check one spool file.

    Raises:
        ValueError: not JSON, another format, or the record hash differs.
        InvalidInput: the record is not canonical JSON material, or a bad ``created_at``.
    """
    record = json.loads(path.read_bytes())
    if not isinstance(record, dict) or record.get("spool_format") != SPOOL_FORMAT:
        raise ValueError("not a spool file of format 1")
    content, rid, at = record.get("content"), record.get("receipt_id"), record.get("created_at")
    if not isinstance(content, dict) or not isinstance(rid, str) or path.stem != rid:
        raise ValueError("no content, or the receipt id differs from the file name")
    if not isinstance(at, str):
        raise ValueError("no created_at")
    claimed = record.pop("record_hash", None)
    if sha256_bytes(jcs_canonical(record)) != claimed:
        raise ValueError("record hash differs (torn or edited file)")
    return SpoolEntry(receipt_id=rid, created_at=to_utc_iso(parse_utc_time(at, "created_at")),
                      content=content, path=path)


def append_spooled(engine: Engine, entry: SpoolEntry) -> tuple[StoredReceipt | None, bool]:
    """Append ``entry`` as its receipt id, once: one write transaction under the receipts lock.

    Returns ``(stored, True)`` when appended now (its journal row, if any, deleted with it);
    ``(stored, False)`` when a receipt with that id and the spooled status is in the chain
    already (the first append committed after all: nothing written); ``(None, False)`` when
    the id is taken by a receipt of another status (e.g. recorded ``interrupted``).

    Raises:
        InvalidInput: the content does not validate.
        sqlalchemy errors: the database cannot be reached (nothing written).
    """
    validate_body(entry.content)
    with write_transaction(engine, WriterLock.RECEIPTS) as session:
        row = session.execute(select(ReceiptRow.seq, ReceiptRow.id, ReceiptRow.hash,
                                     ReceiptRow.prev_hash, ReceiptRow.created_at, ReceiptRow.status)
                              .where(ReceiptRow.id == entry.receipt_id)).first()
        if row is not None:
            session.execute(delete(ReceiptJournalRow).where(ReceiptJournalRow.id == entry.receipt_id))
            if row[5] != entry.content.get("status"):
                return None, False
            return StoredReceipt(*row[:5]), False
        full = append_in_transaction(session, entry.content, entry.receipt_id, check_id=False,
                                     created_at=entry.created_at)
    return StoredReceipt(seq=full["seq"], id=full["id"], hash=full["hash"], prev_hash=full["prev_hash"],
                         created_at=full["created_at"]), True


class SpoolDrainer:
    """Drains a :class:`ReceiptSpool` into ``engine`` in a background thread, with backoff.

    ``engine``: the engine, or a function returning it (resolved at each pass, so a database
    that cannot be opened yet is one more failed pass, not an error at construction).

    :meth:`kick` starts the thread unless it runs; the thread drains, and while receipts are
    left waits ``first_delay_s``, doubling up to ``max_delay_s`` (defaults 0.5 s and 30 s: a
    restart of seconds is caught within about a second, an outage of minutes is retried twice
    a minute), then drains again, until the spool is empty or :meth:`stop`. ``on_drained``
    (optional) is called with each pass's :class:`DrainReport`.
    """

    def __init__(self, spool: ReceiptSpool, engine: Engine | Callable[[], Engine], *,
                 first_delay_s: float = 0.5,
                 max_delay_s: float = 30.0,
                 on_drained: Callable[[DrainReport], None] | None = None) -> None:
        self.spool, self.engine = spool, engine
        self.first_delay_s, self.max_delay_s = first_delay_s, max_delay_s
        self.on_drained = on_drained
        self._lock = threading.Lock()
        self._running = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """True while the background thread runs (receipts were left at its last pass)."""
        with self._lock:
            return self._running

    def kick(self) -> None:
        """Start draining in the background unless a drain thread runs already."""
        with self._lock:
            if self._running:
                return
            self._running = True
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="ragbudget-receipt-spool",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the background thread (spooled receipts stay for the next start or kick)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        delay = self.first_delay_s
        while True:
            try:
                engine = self.engine() if callable(self.engine) else self.engine
                report = self.spool.drain(engine)
            except Exception as exc:  # the database cannot even be opened yet
                report = DrainReport(left=len(self.spool.ids()), error=str(exc)[:300] or "error")
            if self.on_drained is not None:
                try:
                    self.on_drained(report)
                except Exception:
                    log.exception("on_drained failed")
            if report.error is not None:
                log.warning("%d spooled receipt(s) wait for the database (%s); retry in %.1f s",
                            report.left, report.error, delay)
            with self._lock:
                if self._stop.is_set() or (report.error is None and not self.spool.ids()):
                    self._running = False
                    return
            if report.error is None:
                delay = self.first_delay_s  # a file arrived during the pass: drain it soon
            if self._stop.wait(delay):
                with self._lock:
                    self._running = False
                return
            if report.error is not None:
                delay = min(delay * 2.0, self.max_delay_s)
