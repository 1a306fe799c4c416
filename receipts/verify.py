"""Verify the whole receipt chain and locate every problem.

The walk reads receipts in ``seq`` order, in batches (keyset paging, so memory
stays flat for millions of receipts), and for each one recomputes the hash from
the stored body. Problem kinds:

* ``edited``: the body no longer matches its own hash (a field or a score was
  changed), the stored text is not byte for byte the canonical form of the body
  it holds (pretty-printed, a duplicated key: :func:`check_stored_form`), or a
  row column (id, status, created_at, prev_hash) or the ``receipt_documents``
  index disagrees with the body;
* ``hash_mismatch``: the body's ``hash`` and the row's ``hash`` column differ
  (one of them was replaced);
* ``broken_link``: the body's ``prev_hash`` is not the hash of the receipt
  before it (the predecessor was rewritten, hash and all, or the link edited);
* ``missing``: a gap in ``seq`` (a receipt was deleted), or the anchored head
  (``expected_head``) is not in the chain (the tail was cut or rewritten);
* ``reordered``: a receipt sits at a position other than the one its body
  records (rows swapped); its link is then checked against the receipt that
  claims the previous position.

Each tamper is reported where it happened: a link is accepted when it equals
any of the predecessor's recomputed, body or column hash, so an edit of one
receipt is not reported a second time as a broken link of the next.
Deleting the newest receipts leaves no gap; only an anchored head (the hash an
operator noted earlier, ``ragbudget receipts verify --expect-head``) detects it.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import Engine, select

from foundation.db import read_session
from foundation.errors import IntegrityFailure, InvalidInput
from receipts.canonical import stored_form_problem
from receipts.chain import GENESIS, parse_body, receipt_hash
from receipts.models import ReceiptDocument, ReceiptRow
from receipts.schema import FORMAT_VERSION, document_versions

KINDS = ("edited", "hash_mismatch", "broken_link", "missing", "reordered")
WINDOW = 4096  # how far back (in seq) a reordered receipt's predecessor is looked up
COLUMNS = ("id", "status", "created_at", "prev_hash")
MAX_BATCH_SIZE = 100_000  # receipts per query; bounds the memory of one batch
HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Problem:
    """One located problem: ``kind`` (see :data:`KINDS`), where, expected vs actual."""

    kind: str
    seq: int | None
    receipt_id: str | None
    expected: Any
    actual: Any
    detail: str


@dataclass
class VerifyReport:
    """Result of :func:`verify_chain`. ``ok`` iff no problem was found."""

    checked: int = 0
    head: dict[str, Any] | None = None
    problems: list[Problem] = field(default_factory=list)
    elapsed_ms: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the walk found no problem."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """``{ok, checked, head, problems, elapsed_ms}``: ``checked`` receipts walked, ``head``
        the last one's ``{seq, hash, ...}`` (null for an empty chain), each problem as
        :class:`Problem`'s fields, ``elapsed_ms`` rounded to 0.001 ms."""
        return {"ok": self.ok, "checked": self.checked, "head": self.head,
                "problems": [asdict(p) for p in self.problems], "elapsed_ms": round(self.elapsed_ms, 3)}

    def render(self) -> str:
        """Human-readable summary, one line per problem."""
        head = f"head seq {self.head['seq']} {self.head['hash']}" if self.head else "empty chain"
        lines = [f"{'OK' if self.ok else 'FAILED'}: {self.checked} receipts checked, {head}"]
        for p in self.problems:
            where = f"seq {p.seq}" if p.seq is not None else "chain"
            lines.append(f"  {p.kind:<13} {where} {p.receipt_id or ''}: {p.detail}")
            lines.append(f"    expected {p.expected!r}\n    actual   {p.actual!r}")
        return "\n".join(lines)


class _Walk:
    """State of one walk over the chain (kept small: a bounded window of recent hashes)."""

    def __init__(self, expected_head: str | None) -> None:
        self.report = VerifyReport()
        self.prev_seq = 0
        self.recent: dict[int, set[str]] = {}  # claimed seq -> {recomputed, body, column} hashes
        self.missing: list[tuple[int, int]] = []  # inclusive seq ranges
        self.pending: dict[int, list[tuple[int, str | None, Any]]] = defaultdict(list)
        self.expected_head = expected_head
        self.head_found = expected_head is None

    def add(self, kind: str, seq: int | None, rid: str | None, expected: Any, actual: Any,
            detail: str) -> None:
        self.report.problems.append(Problem(kind, seq, rid, expected, actual, detail))

    def is_missing(self, seq: int) -> bool:
        return any(lo <= seq <= hi for lo, hi in self.missing)

    def check_link(self, seq: int, rid: str | None, prev_hash: Any, accepted: set[str]) -> None:
        if prev_hash not in accepted:
            self.add("broken_link", seq, rid, sorted(accepted)[0] if len(accepted) == 1 else sorted(accepted),
                     prev_hash, "prev_hash is not the hash of the previous receipt: the previous receipt "
                     "was rewritten (hash included) or this link was edited")

    def row(self, row: Any, docs: set[tuple[str, int]]) -> None:
        seq, rid = row.seq, row.id
        self.report.checked += 1
        if seq != self.prev_seq + 1:
            lo, hi = self.prev_seq + 1, seq - 1
            self.missing.append((lo, hi))
            span = f"receipt {lo} is" if lo == hi else f"receipts {lo}..{hi} are"
            self.add("missing", lo, None, lo, seq, f"{span} missing (next present: {seq})")
        self.prev_seq = seq
        if self.expected_head is not None and row.hash == self.expected_head:
            self.head_found = True
        try:
            body = parse_body(row.body)
        except IntegrityFailure as exc:
            self.add("edited", seq, rid, "a JSON object", row.body[:80], str(exc))
            self.recent[seq] = {row.hash}
            return
        check_stored_form(self, row)
        recomputed, in_body = receipt_hash(body), body.get("hash")
        if recomputed not in (in_body, row.hash):
            self.add("edited", seq, rid, in_body, recomputed,
                     "the body does not match its recorded hash: a field was changed")
        if in_body != row.hash:
            expected = recomputed if recomputed in (in_body, row.hash) else in_body
            actual = row.hash if expected == in_body else in_body
            self.add("hash_mismatch", seq, rid, expected, actual,
                     "the body's hash and the row's hash column differ: one was replaced")
        for col in COLUMNS:
            if getattr(row, col) != body.get(col):
                self.add("edited", seq, rid, body.get(col), getattr(row, col),
                         f"row column {col!r} differs from the body")
        version = body.get("format_version")
        if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
            self.add("edited", seq, rid, f"1..{FORMAT_VERSION}", version, "unknown format_version")
        try:
            expected_docs = set(document_versions(body))
        except (KeyError, TypeError, ValueError):
            expected_docs = set()
        if docs != expected_docs:
            self.add("edited", seq, rid, sorted(expected_docs), sorted(docs),
                     "the receipt_documents index differs from the body's candidates")
        claimed = body.get("seq")
        if not isinstance(claimed, int) or isinstance(claimed, bool):
            claimed = seq
        elif claimed != seq:
            self.add("reordered", seq, rid, seq, claimed,
                     f"the receipt at position {seq} records position {claimed}")
        accepted = {h for h in (recomputed, in_body, row.hash) if isinstance(h, str)}
        prev_hash = body.get("prev_hash")
        if claimed == 1:
            self.check_link(seq, rid, prev_hash, {GENESIS})
        elif claimed - 1 in self.recent:
            self.check_link(seq, rid, prev_hash, self.recent[claimed - 1])
        elif not self.is_missing(claimed - 1):
            self.pending[claimed - 1].append((seq, rid, prev_hash))
        self.recent[claimed] = accepted
        for waiting_seq, waiting_id, waiting_prev in self.pending.pop(claimed, []):
            self.check_link(waiting_seq, waiting_id, waiting_prev, accepted)
        if len(self.recent) > 2 * WINDOW:
            for old in [s for s in self.recent if s < seq - WINDOW]:
                del self.recent[old]
        self.report.head = {"seq": seq, "id": rid, "hash": row.hash}

    def finish(self) -> VerifyReport:
        for missing_pred, waiting in sorted(self.pending.items()):
            for seq, rid, prev_hash in waiting:
                self.add("broken_link", seq, rid, f"hash of receipt {missing_pred}", prev_hash,
                         f"no receipt claims position {missing_pred} near this one")
        if not self.head_found:
            self.add("missing", None, None, self.expected_head,
                     self.report.head["hash"] if self.report.head else None,
                     "the anchored head is not in the chain: receipts were cut from the end or rewritten")
        return self.report


def check_stored_form(walk: _Walk, row: Any) -> None:
    """Report ``edited`` when the stored body text is not byte for byte its own canonical form.

    The hash covers the parsed content, so a body re-serialised after hashing
    (pretty-printed, keys reordered) or given a second copy of a key (which a
    JSON reader silently resolves to one value) would otherwise verify.
    """
    problem = stored_form_problem(row.body)
    if problem is not None:
        walk.add("edited", row.seq, row.id, "the canonical form of the stored body", "other bytes",
                 f"stored body is not canonical: {problem}")


def verify_chain(engine: Engine, *, batch_size: int = 1000,
                 expected_head: str | None = None) -> VerifyReport:
    """Walk every receipt in ``seq`` order and report every problem (see module docstring).

    Args:
        engine: the database holding the chain.
        batch_size: receipts read per query (keyset paging by ``seq``).
        expected_head: a receipt hash noted earlier (e.g. from a previous verify); when
            given and absent from the chain, a ``missing`` problem is reported.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True iff nothing was found.

    Raises:
        InvalidInput: ``batch_size`` is not an integer in ``[1, MAX_BATCH_SIZE]``, or
            ``expected_head`` is not a ``sha256:`` + 64 lowercase hex hash. An audit
            can never be made to pass by an option (a batch of 0 would read nothing).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) \
            or not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise InvalidInput(f"batch_size must be an integer in [1, {MAX_BATCH_SIZE}], got {batch_size!r}",
                           param="batch_size")
    if expected_head is not None and not (isinstance(expected_head, str)
                                          and HASH_RE.fullmatch(expected_head)):
        raise InvalidInput("expected_head must be 'sha256:' followed by 64 lowercase hex digits",
                           param="expected_head")
    start = time.perf_counter()
    walk = _Walk(expected_head)
    after = 0
    cols = (ReceiptRow.seq, ReceiptRow.id, ReceiptRow.created_at, ReceiptRow.status,
            ReceiptRow.prev_hash, ReceiptRow.hash, ReceiptRow.body)
    with read_session(engine) as session:
        while True:
            rows = session.execute(select(*cols).where(ReceiptRow.seq > after)
                                   .order_by(ReceiptRow.seq).limit(batch_size)).all()
            if not rows:
                break
            docs: dict[int, set[tuple[str, int]]] = defaultdict(set)
            for rseq, doc_id, version in session.execute(
                    select(ReceiptDocument.receipt_seq, ReceiptDocument.document_id, ReceiptDocument.version)
                    .where(ReceiptDocument.receipt_seq.between(rows[0].seq, rows[-1].seq))):
                docs[rseq].add((doc_id, version))
            for row in rows:
                walk.row(row, docs.get(row.seq, set()))
            after = rows[-1].seq
    report = walk.finish()
    report.elapsed_ms = (time.perf_counter() - start) * 1000.0
    return report
