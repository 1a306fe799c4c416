"""Receipt tables: the chained log and a document index for "which answers used this document?"."""

from __future__ import annotations

from sqlalchemy import ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from foundation.db import Base
from retrieval.models import HASH_LEN


class ReceiptRow(Base):
    """One receipt. ``seq`` is its position in the chain (1, 2, ...).

    ``body`` is the canonical JSON the ``hash`` covers; ``prev_hash`` is the
    previous receipt's hash (``sha256:0...0`` for the first). ``prev_hash`` is
    unique, so two writers can never both extend the same head: the chain
    cannot fork.
    """

    __tablename__ = "receipts"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[str] = mapped_column(String(40), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    prev_hash: Mapped[str] = mapped_column(String(HASH_LEN), unique=True)
    hash: Mapped[str] = mapped_column(String(HASH_LEN), unique=True)
    body: Mapped[str] = mapped_column(Text)


class ReceiptDocument(Base):
    """A document version a receipt's candidates came from (for filtering receipts)."""

    __tablename__ = "receipt_documents"

    receipt_seq: Mapped[int] = mapped_column(ForeignKey("receipts.seq"), primary_key=True)
    document_id: Mapped[str] = mapped_column(String(1024), primary_key=True, index=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)


class ReceiptJournalRow(Base):
    """An answer that started generating and has no receipt yet (``receipts.journal``).

    ``id`` is the receipt id the answer's receipt will carry; ``body`` the receipt body
    as known when generation started (canonical JSON, no output); ``host``/``pid``/
    ``process`` name the process serving the answer (:mod:`foundation.processes`).
    Deleted in the transaction that appends the answer's receipt; a row whose process
    is gone becomes an ``interrupted`` receipt at the next start.
    """

    __tablename__ = "receipt_journal"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[str] = mapped_column(String(40))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    process: Mapped[str] = mapped_column(String(128))
    body: Mapped[str] = mapped_column(Text)


class ReceiptTurn(Base):
    """The turn a receipt answered, by content (``receipts.turns``): ``turn_hash`` is
    :func:`receipts.turns.turn_hash` of its request messages followed by its answer, so a
    follow-up whose history is exactly that conversation finds the receipt (and the exact
    tokens it showed and produced) by an index lookup."""

    __tablename__ = "receipt_turns"

    #: no foreign key: a row whose receipt was removed is ignored (:func:`receipts.turns.find_turn`
    #: joins the receipts), and nothing that removes receipts needs to know of this table
    receipt_seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    turn_hash: Mapped[str] = mapped_column(String(HASH_LEN), index=True)
