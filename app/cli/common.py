"""Helpers shared by CLI command modules: output, errors, the services container."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from foundation.errors import (
    AuthError,
    Busy,
    IntegrityFailure,
    InvalidConfig,
    InvalidInput,
    NotFound,
    RagBudgetError,
)

# Exit codes, mapped only here (the edge): 0 ok, 1 failure, 2 bad input/usage,
# 3 not found, 4 a verification failed, 5 busy, 6 auth. A bad setting (InvalidConfig, a
# server-side 500 over HTTP) is the CLI user's own input: 2 as well.
EXIT_CODES: list[tuple[type[RagBudgetError], int]] = [
    (InvalidConfig, 2),
    (InvalidInput, 2),
    (NotFound, 3),
    (IntegrityFailure, 4),
    (Busy, 5),
    (AuthError, 6),
    (RagBudgetError, 1),
]


def exit_code_for(exc: RagBudgetError) -> int:
    """The process exit code for a ragbudget error."""
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return 1


def seed_arg(text: str) -> int:
    """argparse ``type`` for seeds: an integer in ``0..2**53 - 1`` (JSON-safe in every reader)."""
    from generation.base import MAX_SEED

    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from exc
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"a seed must be in [0, 2**53 - 1], got {value}")
    return value


def int_in_range(lo: int, hi: int) -> Callable[[str], int]:
    """argparse ``type`` for an integer in ``[lo, hi]``; anything else is a usage error (exit 2)."""

    def parse(text: str) -> int:
        if not re.fullmatch(r"[+-]?[0-9]{1,20}", text.strip()):
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
        value = int(text.strip())
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """Add the ``--json`` flag every result-printing command has."""
    parser.add_argument("--json", action="store_true", help="machine-readable JSON output")


def emit(args: argparse.Namespace, payload: Any, human: Callable[[Any], str] | None = None) -> None:
    """Print ``payload`` as JSON (``--json``) or through ``human`` (default: pretty JSON).

    A pydantic model is printed as its JSON dump; ``human`` receives the model itself.
    """
    if getattr(args, "json", False) or human is None:
        data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
        print(json.dumps(data, indent=None if getattr(args, "json", False) else 2,
                         sort_keys=True, ensure_ascii=False, default=str))
    else:
        print(human(payload))


def fail(args: argparse.Namespace, exc: RagBudgetError) -> int:
    """Report ``exc`` on stderr (or as JSON on stdout with ``--json``) and return its exit code."""
    if getattr(args, "json", False):
        print(json.dumps({"error": exc.to_dict()}, sort_keys=True, ensure_ascii=False, default=str))
    else:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
    return exit_code_for(exc)
