"""Entry point of the ``ragbudget`` console script.

Each command group lives in its own module under ``app.cli`` and exposes
``register(subparsers)``; every command function takes ``(args, services)``
and returns an exit code. Errors derived from ``RagBudgetError`` become a
message and a non-zero exit code (see ``app.cli.common.EXIT_CODES``).
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType

from app.cli import (
    answer_cmds,
    corpus_cmds,
    db_cmds,
    demo_cmds,
    key_cmds,
    latency_cmds,
    receipt_cmds,
    retrieve_cmds,
    serve_cmds,
    sweep_cmds,
)
from app.cli.common import fail
from foundation.errors import InvalidConfig, RagBudgetError

# Command-group modules, in help order, registered explicitly. Each has register(subparsers).
COMMAND_MODULES: tuple[ModuleType, ...] = (
    db_cmds, corpus_cmds, retrieve_cmds, latency_cmds, answer_cmds, receipt_cmds, key_cmds,
    serve_cmds, demo_cmds, sweep_cmds,
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, every command group in :data:`COMMAND_MODULES`."""
    parser = argparse.ArgumentParser(
        prog="ragbudget", description="RAG context-budget advisor with retrieval receipts."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the command, return its exit code."""
    from pydantic import ValidationError
    from sqlalchemy.exc import SQLAlchemyError

    from app.services import Services
    from app.settings import get_settings
    from foundation.db_errors import translate_db_error

    parser = build_parser()
    args = parser.parse_args(argv)
    services = None
    try:
        services = Services(get_settings())
        return int(args.func(args, services) or 0)
    except RagBudgetError as exc:
        return fail(args, exc)
    except SQLAlchemyError as exc:
        return fail(args, translate_db_error(exc))
    except ValidationError as exc:  # settings from the environment out of range
        return fail(args, InvalidConfig(f"invalid settings: {exc.errors()[0].get('loc')}: "
                                        f"{exc.errors()[0].get('msg')}", errors=exc.error_count()))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader (e.g. ``| head``) went away: stop quietly, as other CLI tools do.
        # Point stdout at devnull so the interpreter's final flush does not raise again
        # (https://docs.python.org/3/library/signal.html#note-on-sigpipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as exc:
        # No traceback for a user: one line and exit 1 (RAGBUDGET_DEBUG=1 shows it).
        if os.environ.get("RAGBUDGET_DEBUG") == "1":
            raise
        return fail(args, RagBudgetError(f"internal error: {type(exc).__name__}: {exc}"[:500],
                                         code="internal_error"))
    finally:
        if services is not None:
            services.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
