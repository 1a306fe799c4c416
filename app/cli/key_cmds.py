"""``ragbudget keys create|list|revoke``: API keys (stored only as salted hashes)."""

from __future__ import annotations

import argparse

from app.auth import ROLES, create_key, list_keys, revoke_key
from app.cli.common import add_json_flag, emit


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``keys create|list|revoke`` to the top-level subparsers ``sub``."""
    keys = sub.add_parser("keys", help="manage API keys")
    ks = keys.add_subparsers(dest="keys_command", metavar="ACTION")
    ks.required = True
    c = ks.add_parser("create", help="create a key (shown once)")
    c.add_argument("--role", required=True, choices=ROLES)
    c.add_argument("--name", default="")
    add_json_flag(c)
    c.set_defaults(func=cmd_create)
    ls = ks.add_parser("list", help="list keys (never their secrets)")
    add_json_flag(ls)
    ls.set_defaults(func=cmd_list)
    r = ks.add_parser("revoke", help="revoke a key")
    r.add_argument("id")
    add_json_flag(r)
    r.set_defaults(func=cmd_revoke)


def cmd_create(args: argparse.Namespace, services) -> int:  # type: ignore[no-untyped-def]
    """``ragbudget keys create``: create a key with ``--role`` and ``--name`` and print it once
    (``rb_<id>_<secret>``; only a salted hash is stored). Returns 0."""
    principal, key = create_key(services.engine, args.role, args.name)
    emit(args, {"id": principal.id, "name": principal.name, "role": principal.role, "key": key},
         lambda p: f"created {p['role']} key {p['id']} ({p['name']}).\n"
                   f"key (shown once, store it now): {p['key']}")
    return 0


def cmd_list(args: argparse.Namespace, services) -> int:  # type: ignore[no-untyped-def]
    """``ragbudget keys list``: every key's id, role, name, created_at and revoked_at (never a
    secret). Returns 0."""
    rows = list_keys(services.engine)

    def human(rows: list[dict]) -> str:
        lines = [f"{'id':16}  {'role':8}  {'name':20}  {'created_at':32}  revoked_at"]
        lines += [f"{r['id']:16}  {r['role']:8}  {r['name'][:20]:20}  {r['created_at']:32}  "
                  f"{r['revoked_at'] or '-'}" for r in rows]
        return "\n".join(lines)

    emit(args, rows, human)
    return 0


def cmd_revoke(args: argparse.Namespace, services) -> int:  # type: ignore[no-untyped-def]
    """``ragbudget keys revoke ID``: revoke a key (idempotent). Returns 0; an unknown id raises
    ``NotFound`` (exit 3)."""
    revoke_key(services.engine, args.id)
    emit(args, {"id": args.id, "revoked": True}, lambda p: f"revoked {p['id']}")
    return 0
