"""Property-based test over every CLI command's arguments: hostile values (NUL, lone surrogates,
Unicode digits, numbers beyond 64 bits, out-of-range times, empty strings, special files) end in
a documented exit code and a message, never a traceback or an ``internal_error``.

Commands that only touch the database run for real (SQLite and PostgreSQL). Commands that load
models, start a server or read the network-sized corpus (``HEAVY``) are fuzzed through argument
parsing only: a value their parser accepts would start minutes of work per example.
"""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.cli.main import build_parser, main

HEAVY = {"ingest", "corpus fetch", "retrieve", "reindex", "calibrate", "ask", "advise", "serve", "demo",
         "sweep"}
EXIT_CODES = {0, 1, 2, 3, 4, 5, 6}
HOSTILE = ["", " ", "0", "-1", "1", "²", "١٢", "99999999999999999999999", "-9223372036854775809",
           "9223372036854775807", "a\x00b", "\x00", "\ud800", "x" * 5000, "é" * 600, "NaN", "inf", "1e999",
           "0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00", "2026-13-45", "/dev/zero",
           "/nonexistent", "../../etc/passwd", "sha256:" + "0" * 64, "sha256:zz", "operator", "admin",
           "ok", "yes", "--", "-x", "%s%n", "'; DROP TABLE receipts; --"]


def _commands() -> dict[str, argparse.ArgumentParser]:
    out: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, prefix: list[str]) -> None:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out[" ".join(prefix)] = p
            return
        for name, sp in subs[0].choices.items():
            walk(sp, [*prefix, name])

    walk(build_parser(), [])
    return out


COMMANDS = _commands()
LIGHT = sorted(c for c in COMMANDS if c not in HEAVY)


def _argv(command: str) -> st.SearchStrategy[list[str]]:
    options = [o for a in COMMANDS[command]._actions for o in a.option_strings if o not in ("-h", "--help")]
    token = st.one_of(st.sampled_from(HOSTILE), st.sampled_from(options or ["--json"]),
                      st.text(max_size=12))
    return st.lists(token, max_size=6).map(lambda rest: [*command.split(), *rest])


def _run(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: usage error (2) or --help (0)
            code = int(exc.code or 0)
    return code, err.getvalue() + out.getvalue()


def test_every_command_is_covered():
    assert set(COMMANDS) == set(LIGHT) | HEAVY


@pytest.mark.parametrize("command", LIGHT)
def test_light_commands_never_trace_back(settings_env, command):
    @given(argv=_argv(command))
    @settings(max_examples=25, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(argv: list[str]) -> None:
        code, text = _run(argv)
        assert code in EXIT_CODES, (argv, code, text[-500:])
        assert "Traceback" not in text and "internal_error" not in text, (argv, text[-1500:])

    run()


@pytest.mark.parametrize("command", sorted(HEAVY))
def test_heavy_commands_parse_or_refuse_with_exit_2(command):
    parser = build_parser()

    @given(argv=_argv(command))
    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(argv: list[str]) -> None:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                parser.parse_args(argv)
            except SystemExit as exc:
                assert exc.code in (0, 2), (argv, exc.code)
        assert "Traceback" not in err.getvalue()

    run()


@pytest.fixture
def settings_env(settings, monkeypatch):
    """Point the CLI at the database under test (SQLite or PostgreSQL), auth off."""
    monkeypatch.setenv("RAGBUDGET_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("RAGBUDGET_DATABASE_URL", settings.resolved_database_url)
    monkeypatch.setenv("RAGBUDGET_AUTH_ENABLED", "false")
    return settings
