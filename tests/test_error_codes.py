"""One enumeration of every public error code (``foundation.error_codes.ErrorCode``), kept whole.

The rooms are walked with :mod:`ast` (:mod:`tests.error_code_uses`, whose docstring lists
the forms a code is recognised in): every code they use must be a member, every member
must be used, each member's stated HTTP status must be the one ``app.api.errors`` answers
for the class the code is raised with, and ``docs/errors.md`` must hold the generated table.
``InvalidConfig`` is the server's own error: 500 over HTTP, exit 2 on the CLI.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from app.api.errors import status_for
from app.cli.common import exit_code_for
from foundation import errors
from foundation.error_codes import BEGIN, END, ErrorCode, markdown_table, with_table
from foundation.errors import InvalidConfig, InvalidInput, RagBudgetError
from tests.error_code_uses import ROOT, CodeUse, code_uses, module_uses

HOW_TO_ADD = ("To add a code: give foundation/error_codes.py's ErrorCode a member\n"
              '    NAME = ("name", <error class or None>, <HTTP status or None>, <retry helps: bool>, '
              '"<one-line meaning>")\n'
              "then run `python -m foundation.error_codes --update docs/errors.md` and commit both.\n"
              "If the code is a typo for an existing one, use that one instead.")


def _status_of(class_name: str) -> int:
    """What ``app.api.errors`` answers for an error of class ``class_name`` (``foundation.errors``)."""
    cls = getattr(errors, class_name)
    return status_for(cls.__new__(cls))


def unknown_codes_report(uses: list[CodeUse]) -> str:
    """The failure message for uses of codes that are not :class:`ErrorCode` members ("" when none):
    one line per site (``path:line: 'code' in <form>``), a suggested member for each new code,
    and how to add it."""
    known = {c.value for c in ErrorCode}
    unknown = [u for u in uses if u.code not in known]
    if not unknown:
        return ""
    lines = [f"{len(unknown)} use(s) of error codes missing from foundation.error_codes.ErrorCode:"]
    lines += [f"  {u.where()}: {u.code!r} in {u.form}" for u in unknown]
    lines.append("Suggested members (check the status and write the meaning):")
    for code in sorted({u.code for u in unknown}):
        site = next(u for u in unknown if u.code == code)
        status = site.status if site.status is not None else (
            _status_of(site.raised_as) if site.raised_as is not None else None)
        lines.append(f'    {code.upper()} = ("{code}", {site.raised_as}, {status}, False, "...")')
    return "\n".join(lines + [HOW_TO_ADD])


def test_every_code_the_rooms_use_is_in_the_enumeration() -> None:
    uses, _ = code_uses()
    assert len({u.path for u in uses}) > 20  # the walk reached the rooms
    report = unknown_codes_report(uses)
    assert not report, report


def test_every_member_is_used_somewhere() -> None:
    uses, refs = code_uses()
    named = {name for name, _, _ in refs if name in ErrorCode.__members__}
    used = {u.code for u in uses} | {ErrorCode[name].value for name in named}
    dead = [c for c in ErrorCode if c.value not in used]
    assert not dead, ("ErrorCode members that no module of app/, foundation/, generation/, retrieval/, "
                      "receipts/ or latency_model/ uses (remove them from foundation/error_codes.py and "
                      "run `python -m foundation.error_codes --update docs/errors.md`): "
                      + ", ".join(c.value for c in dead))


def test_every_member_is_its_code_in_capitals_with_a_meaning() -> None:
    for code in ErrorCode:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", code.value), code.value
        assert code.name == code.value.upper() and code.meaning.strip(), code.name
    assert len(ErrorCode) > 50


def test_a_members_stated_status_is_what_the_api_answers_for_its_class() -> None:
    wrong = [f"{c.value}: stated {c.http_status}, app.api.errors answers "
             f"{status_for(c.raised_as.__new__(c.raised_as))} for {c.raised_as.__name__}"
             for c in ErrorCode if c.raised_as is not None
             and status_for(c.raised_as.__new__(c.raised_as)) != c.http_status]
    assert not wrong, "\n".join(wrong)


def test_every_site_raises_its_code_with_the_stated_status() -> None:
    uses, _ = code_uses()
    members = {c.value: c for c in ErrorCode}
    wrong = []
    for u in uses:
        member = members.get(u.code)
        if member is None:
            continue  # reported by test_every_code_the_rooms_use_is_in_the_enumeration
        site = u.status if u.status is not None else (
            _status_of(u.raised_as) if u.raised_as is not None else None)
        if site is not None and site != member.http_status:
            wrong.append(f"{u.where()}: {u.code!r} answers {site} here ({u.form}, "
                         f"{u.raised_as or 'written directly'}); ErrorCode states {member.http_status}")
    assert not wrong, "\n".join(wrong)


def test_an_error_classes_own_code_names_that_class() -> None:
    uses, _ = code_uses()
    own = [u for u in uses if u.form.startswith("class ") and u.raised_as is not None]
    assert {u.raised_as for u in own} >= {"RagBudgetError", "InvalidInput", "InvalidConfig", "Busy"}
    members = {c.value: c for c in ErrorCode}
    for u in own:
        assert members[u.code].raised_as is getattr(errors, str(u.raised_as)), (u.where(), u.code)


def test_a_stray_code_is_reported_with_its_file_line_and_how_to_add_it() -> None:
    source = ('from foundation.errors import InvalidInput\n\n'
              'def check(x):\n'
              '    raise InvalidInput("bad x", code="nope")\n')
    uses, _ = module_uses(source, "app/stray.py")
    assert [(u.code, u.where(), u.raised_as) for u in uses] == [("nope", "app/stray.py:4", "InvalidInput")]
    report = unknown_codes_report(uses)
    assert "app/stray.py:4: 'nope' in InvalidInput(..., code=...)" in report
    assert 'NOPE = ("nope", InvalidInput, 422, False, "...")' in report
    assert "--update docs/errors.md" in report


def test_every_form_of_naming_a_code_is_found() -> None:
    source = '''
BAD = "bad_constant"
_X_CODES = {404: "route_missing"}
_ERRORS = {"mapped_key": TooLarge}

class Odd(RagBudgetError):
    code = "own_code"

def f(exc, req, refused, p):
    ItemResult("d", "rejected", code="item_code")
    yield {"code": getattr(exc, "code", "default_code"), "message": "m"}
    AnswerError(code=str(getattr(exc, "code", "str_default")))
    respond(req, 500, "responded", "m", {})
    error_body("body_code", "m")
    InvalidInput("m", code=exc.code or "fallback")
    _X_CODES.get(418, "get_default")
    refused.append((p, "refused_code", "reason"))
    respond(req, 409, ErrorCode.CONFLICT, "m", {})
    return {"error": {"code": BAD}}, ErrorCode.BUSY
'''
    uses, refs = module_uses(source, "app/forms.py")
    found = {u.code: u for u in uses}
    assert set(found) == {"bad_constant", "route_missing", "mapped_key", "own_code", "item_code",
                          "default_code", "str_default", "responded", "body_code", "fallback",
                          "get_default", "refused_code", "conflict"}
    assert found["route_missing"].status == 404 and found["responded"].status == 500
    assert found["conflict"].status == 409
    assert found["mapped_key"].raised_as == "TooLarge" and found["own_code"].raised_as == "RagBudgetError"
    assert refs == [("CONFLICT", "app/forms.py", 18), ("BUSY", "app/forms.py", 19)]


def test_docs_errors_md_holds_the_generated_table() -> None:
    text = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    assert BEGIN in text and END in text
    assert with_table(text) == text, ("docs/errors.md differs from foundation/error_codes.py: run "
                                      "`python -m foundation.error_codes --update docs/errors.md`")


def test_the_markdown_flag_prints_one_row_per_code() -> None:
    out = subprocess.run([sys.executable, "-m", "foundation.error_codes", "--markdown"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out == markdown_table()
    rows = out.splitlines()[2:]
    assert [r.split("|")[1].strip().strip("`") for r in rows] == [c.value for c in ErrorCode]
    assert "| `invalid_config` | 500 | no | `InvalidConfig` |" in out


def test_update_rewrites_only_the_part_between_the_markers(tmp_path: Path) -> None:
    doc = tmp_path / "errors.md"
    doc.write_text(f"# Errors\n\nintro\n\n{BEGIN}\nstale\n{END}\n\nafter\n", encoding="utf-8")
    subprocess.run([sys.executable, "-m", "foundation.error_codes", "--update", str(doc)], cwd=ROOT,
                   check=True)
    assert doc.read_text(encoding="utf-8") == (f"# Errors\n\nintro\n\n{BEGIN}\n{markdown_table()}{END}"
                                                "\n\nafter\n")


def test_invalid_config_is_a_server_error_over_http_and_exit_2_on_the_cli() -> None:
    exc = InvalidConfig("chunk overlap not below the window")
    assert not isinstance(exc, InvalidInput) and isinstance(exc, RagBudgetError)
    assert exc.code == "invalid_config" and status_for(exc) == 500 and exit_code_for(exc) == 2
    assert status_for(InvalidConfig("no template", code="no_chat_template")) == 500
