"""The started-answer journal: an answer cut by SIGKILL still gets a receipt, at the next start.

When an answer gets the model, before its first token, the pipeline writes one
``receipt_journal`` row (:func:`open_entry`): the receipt id the answer will use,
the receipt body as known then (question, request, corpus revision and root,
candidates with chunk hashes, the plan and chosen k, scaffold, prompt token-id
hash and counts, generator and parameters, timings so far; ``status``
``interrupted``, no output) and the serving process (host, pid, and the
``boot id/start time`` token of :mod:`foundation.processes`). The transaction
that appends the answer's real receipt deletes the row
(:func:`receipts.chain.append_in_transaction`), so a row outlives its answer
only when the process died without writing the receipt (SIGKILL, OOM, power), or
while the answer's finished receipt waits in the spool for the database
(:mod:`receipts.spool`), whose drain deletes the row when it appends the receipt.

:func:`recover_interrupted` (run when the API starts) turns every row whose
process is gone into a receipt with status ``interrupted``, appended to the
chain under the receipts lock, one transaction per row (the receipt and the
row's deletion together, or neither). The rule "gone": the row's host is this
host and no process with its pid, boot id and start time runs. Rows of live
processes (other workers of the same server, a running ``ragbudget ask``) are
left alone; so are rows of other hosts, which only a start on their own host
recovers, or an operator who names the host as gone for good (``ragbudget receipts
recover --host-gone HOST``; docs/receipts.md).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, delete, insert, select

from foundation.db import WriterLock, read_session, write_transaction
from foundation.errors import InvalidInput, RagBudgetError
from foundation.processes import ProcessIdentity, current_process, owner_gone
from foundation.provenance import utc_now_iso
from receipts.canonical import canonical_body
from receipts.chain import StoredReceipt, append_in_transaction, parse_body
from receipts.models import ReceiptJournalRow, ReceiptRow
from receipts.schema import CHAIN_FIELDS, validate_body

log = logging.getLogger("ragbudget.receipts")

INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class JournalEntry:
    """One journal row: a started answer without a receipt (see the module docstring)."""

    id: str
    created_at: str
    host: str
    pid: int
    process: str


def open_entry(engine: Engine, receipt_id: str, body: dict[str, Any],
               owner: ProcessIdentity | None = None) -> None:
    """Write the journal row of an answer that starts generating (one short write transaction).

    ``body``: the receipt body without chain fields, ``status`` ``interrupted`` and ``output``
    null, as :func:`recover_interrupted` will append it should the answer never finish.
    ``owner``: the serving process (default: this one).

    Raises:
        InvalidInput: ``body`` is not a valid receipt body with status ``interrupted``.
    """
    validate_body(body)
    if body.get("status") != INTERRUPTED or body.get("output") is not None:
        raise InvalidInput("a journal body has status 'interrupted' and no output", field="status")
    who = owner or current_process()
    content = {k: v for k, v in body.items() if k not in CHAIN_FIELDS or k == "format_version"}
    with write_transaction(engine, WriterLock.JOURNAL) as session:
        session.execute(insert(ReceiptJournalRow).values(
            id=receipt_id, created_at=utc_now_iso(), host=who.host, pid=who.pid, process=who.token,
            body=canonical_body(content).decode("utf-8")))


def pending(engine: Engine) -> list[JournalEntry]:
    """Every journal row, oldest first (answers in flight, and any not yet recovered)."""
    with read_session(engine) as session:
        rows = session.execute(select(ReceiptJournalRow.id, ReceiptJournalRow.created_at,
                                      ReceiptJournalRow.host, ReceiptJournalRow.pid,
                                      ReceiptJournalRow.process)
                               .order_by(ReceiptJournalRow.created_at, ReceiptJournalRow.id)).all()
    return [JournalEntry(*r) for r in rows]


def interrupted_body(stored: dict[str, Any], entry: JournalEntry,
                     recovered_by: ProcessIdentity) -> dict[str, Any]:
    """The receipt body of an interrupted answer: the journal's body with an ``interrupted``
    error and ``extra.interrupted`` (when it started, which process served it, which recorded it)."""
    body = {k: v for k, v in stored.items() if k not in CHAIN_FIELDS}
    body["status"] = INTERRUPTED
    body["output"] = None
    body["error"] = {"code": INTERRUPTED,
                     "message": f"the serving process (pid {entry.pid} on {entry.host}) ended while the "
                                "answer was generating; recorded at the next start, no output is known"}
    extra = dict(body.get("extra") or {})
    extra[INTERRUPTED] = {"started_at": entry.created_at, "host": entry.host, "pid": entry.pid,
                          "recovered_by": {"host": recovered_by.host, "pid": recovered_by.pid}}
    body["extra"] = extra
    return body


def recover_interrupted(engine: Engine, *, hosts_gone: Collection[str] = (),
                        spooled: Collection[str] = ()) -> list[StoredReceipt]:
    """Append an ``interrupted`` receipt for every journal row whose process is gone.

    Gone: a process of this host that no longer runs (:func:`foundation.processes.owner_gone`),
    or any process of a host in ``hosts_gone`` (hosts an operator knows to be down for good;
    ``ragbudget receipts recover --host-gone``). One write transaction per row under
    ``WriterLock.RECEIPTS``: the row is read again under the lock (another process may
    have recovered it meanwhile), its receipt is appended with the row's receipt id and
    the row deleted, together. A row whose id is in ``spooled`` (the answer ended and its
    receipt waits in this host's spool, :mod:`receipts.spool`) is left: the spool's drain
    appends the real receipt and deletes the row. A row whose
    receipt id is already in the chain is only deleted. A row whose body no longer
    validates is logged and left. Returns the receipts appended, in order.

    Raises:
        InvalidInput: ``hosts_gone`` names this host.
    """
    me = current_process()
    if me.host in hosts_gone:
        raise InvalidInput(f"{me.host!r} is this host: its rows are judged by their processes, "
                           "never declared gone", field="hosts_gone")
    appended: list[StoredReceipt] = []
    for entry in pending(engine):
        if entry.id in spooled:
            continue
        if entry.host not in hosts_gone and not owner_gone(entry.host, entry.pid, entry.process):
            continue
        try:
            with write_transaction(engine, WriterLock.RECEIPTS) as session:
                row = session.get(ReceiptJournalRow, entry.id)
                if row is None:
                    continue  # recovered by another process since it was listed
                if session.scalar(select(ReceiptRow.seq).where(ReceiptRow.id == entry.id)) is not None:
                    session.execute(delete(ReceiptJournalRow).where(ReceiptJournalRow.id == entry.id))
                    continue
                body = interrupted_body(parse_body(row.body), entry, me)
                validate_body(body)
                full = append_in_transaction(session, body, entry.id, check_id=False)
        except RagBudgetError:
            log.exception("journal row %s could not be recorded as interrupted; left for the next start",
                          entry.id)
            continue
        appended.append(StoredReceipt(seq=full["seq"], id=full["id"], hash=full["hash"],
                                      prev_hash=full["prev_hash"], created_at=full["created_at"]))
        log.warning("answer %s (pid %d on %s, started %s) was cut off; recorded as interrupted",
                    entry.id, entry.pid, entry.host, entry.created_at)
    return appended
