"""``ragbudget receipts verify|list|show|recover`` and ``ragbudget replay ID [--regenerate]``.

Exit codes: 0 when everything verifies; 4 when ``verify`` finds a problem or a
replay check fails (the code ``app.cli.common`` gives verification failures).
"""

from __future__ import annotations

import argparse
from typing import Any

from app.cli.common import add_json_flag, emit, int_in_range
from receipts.schema import STATUSES

EXIT_VERIFY_FAILED = 4


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``receipts verify|list|show|recover`` and ``replay`` to the top-level subparsers ``sub``."""
    r = sub.add_parser("receipts", help="audit the receipt chain")
    rsub = r.add_subparsers(dest="receipts_command", metavar="ACTION")
    rsub.required = True

    v = rsub.add_parser("verify", help="walk the whole chain and locate any tampering")
    v.add_argument("--expect-head", default=None, metavar="HASH",
                   help="a head hash noted earlier; detects receipts cut from the end")
    v.add_argument("--batch-size", type=int_in_range(1, 100_000), default=1000,
                   help="receipts read per query, 1..100000 (default 1000)")
    add_json_flag(v)
    v.set_defaults(func=cmd_verify)

    ls = rsub.add_parser("list", help="receipts newest first, filtered, one page at a time")
    ls.add_argument("--since", default=None, help="ISO-8601 time (inclusive)")
    ls.add_argument("--until", default=None, help="ISO-8601 time (exclusive)")
    ls.add_argument("--document", dest="document_id", default=None, help="answers that used this document")
    ls.add_argument("--version", dest="document_version", type=int, default=None,
                    help="with --document: only this version")
    ls.add_argument("--status", choices=list(STATUSES), default=None)
    ls.add_argument("--within-budget", choices=["yes", "no"], default=None,
                    help="measured TTFT within (yes) or over (no) the budget")
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--cursor", default=None, help="next_cursor of the previous page")
    add_json_flag(ls)
    ls.set_defaults(func=cmd_list)

    sh = rsub.add_parser("show", help="one receipt's full body and its freshness")
    sh.add_argument("receipt_id")
    add_json_flag(sh)
    sh.set_defaults(func=cmd_show)

    rc = rsub.add_parser("recover", help="record answers whose process died mid-answer as interrupted "
                         "(done at every server start)")
    rc.add_argument("--host-gone", action="append", default=[], metavar="HOST",
                    help="also record the rows of HOST, a host known to be down for good (repeatable)")
    add_json_flag(rc)
    rc.set_defaults(func=cmd_recover)

    rp = sub.add_parser("replay", help="verify a receipt and rebuild exactly what the model was shown")
    rp.add_argument("receipt_id")
    rp.add_argument("--regenerate", action="store_true",
                    help="also generate again with the recorded parameters and compare output tokens")
    add_json_flag(rp)
    rp.set_defaults(func=cmd_replay)


def cmd_verify(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget receipts verify``: walk the whole chain in batches, recompute every hash and
    link and report where it breaks. Returns 0 when it verifies, 4 when it does not."""
    from receipts.verify import verify_chain

    report = verify_chain(services.engine, batch_size=args.batch_size, expected_head=args.expect_head)
    emit(args, report.to_dict(), lambda _p: report.render())
    return 0 if report.ok else EXIT_VERIFY_FAILED


def _render_list(payload: dict[str, Any]) -> str:
    lines = []
    for r in payload["receipts"]:
        k = "-" if r["chosen_k"] is None else r["chosen_k"]
        ttft = "-" if r["ttft_ms"] is None else f"{r['ttft_ms']:.0f} ms"
        lines.append(f"{r['seq']:>6} {r['id']} {r['created_at']} {r['status']:<11} rev {r['revision']} "
                     f"k={k} ttft {ttft}  {r['question'][:60]!r}")
    if payload["next_cursor"]:
        lines.append(f"more: --cursor {payload['next_cursor']}")
    return "\n".join(lines) or "no receipts"


def cmd_list(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget receipts list``: one page of receipts, newest first, filtered (see
    ``receipts.chain.list_receipts``). Returns 0; a bad time, status, limit or cursor raises
    ``InvalidInput`` (exit 2)."""
    from receipts.chain import list_receipts

    page, cursor = list_receipts(services.engine, since=args.since, until=args.until,
                                 document_id=args.document_id, document_version=args.document_version,
                                 status=args.status, limit=args.limit, cursor=args.cursor,
                                 within=None if args.within_budget is None else args.within_budget == "yes")
    emit(args, {"receipts": page, "next_cursor": cursor}, _render_list)
    return 0


def _render_show(payload: dict[str, Any]) -> str:
    import json

    from receipts.freshness import render_freshness

    return json.dumps(payload["receipt"], indent=2, sort_keys=True, ensure_ascii=False) + "\n" + \
        render_freshness(payload["freshness"])


def cmd_show(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget receipts show ID``: the receipt's full body and its freshness. Returns 0; an
    unknown id raises ``UnknownReceipt`` (exit 3)."""
    from receipts.chain import get_receipt
    from receipts.freshness import freshness

    body = get_receipt(services.engine, args.receipt_id)
    emit(args, {"receipt": body, "freshness": freshness(services.engine, body)}, _render_show)
    return 0


def cmd_replay(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget replay ID [--regenerate]``: verify the receipt, re-run its retrieval, rebuild
    its prompt (and regenerate) and report every check. Returns 0 when no check failed, 4
    otherwise; an unknown id raises ``UnknownReceipt`` (exit 3)."""
    from app.answering.receipt_wiring import replay_receipt

    report = replay_receipt(services, args.receipt_id, regenerate=args.regenerate)
    emit(args, report.to_dict(), lambda _p: report.render())
    return 0 if report.ok else EXIT_VERIFY_FAILED


def cmd_recover(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget receipts recover``: append an ``interrupted`` receipt for every started answer
    whose process is gone (:func:`receipts.journal.recover_interrupted`; the API does this at
    start) after appending the receipts spooled during a database outage, and list the journal
    rows left (answers in flight, rows of other hosts). Returns 0;
    naming this host with ``--host-gone`` raises InvalidInput (exit 2)."""
    from app.answering.receipt_wiring import drain_spool
    from receipts.journal import pending, recover_interrupted

    spooled = drain_spool(services)  # a spooled answer gets its own receipt, never interrupted
    recorded = recover_interrupted(services.engine, hosts_gone=frozenset(args.host_gone),
                                   spooled=spooled)
    left = pending(services.engine)
    data = {"recorded": [r.to_dict() for r in recorded],
            "left": [{"id": e.id, "started_at": e.created_at, "host": e.host, "pid": e.pid} for e in left]}
    lines = [f"recorded {len(recorded)} interrupted answer{'' if len(recorded) == 1 else 's'}"]
    lines += [f"  {r.seq:>6} {r.id}" for r in recorded]
    if left:
        lines.append(f"{len(left)} started answer{'' if len(left) == 1 else 's'} left (process running, "
                     "or on another host):")
        lines += [f"  {e.id} started {e.created_at} pid {e.pid} on {e.host}" for e in left]
    emit(args, data, lambda _data: "\n".join(lines))
    return 0
