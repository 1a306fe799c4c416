"""Values no backend can hold (NUL, lone surrogates, beyond 64 bits, times out of range after
conversion to UTC, too many bytes) are refused with a 4xx and a code by the API, and with a
one-line message and exit 2 by the CLI, the same way on SQLite and PostgreSQL; a database or
driver error that still gets through is answered in the error envelope, never a plain 500."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import DataError, IntegrityError, OperationalError

from app.cli.main import main
from foundation.db_errors import translate_db_error
from tests.api.conftest import api_settings, start_keyed_app

HOSTILE_REQUESTS = [
    ("GET", "/v1/receipts/a%00b"),
    ("POST", "/v1/receipts/a%00b/replay"),
    ("GET", "/v1/documents/a%00b"),
    ("GET", "/v1/documents/a%00b/versions"),
    ("GET", "/v1/documents/a%00b/versions/1"),
    ("DELETE", "/v1/documents/a%00b"),
    ("GET", "/v1/document?id=a%00b"),
    ("DELETE", "/v1/keys/a%00b"),
    ("GET", "/v1/receipts?document_id=a%00b"),
    ("GET", "/v1/receipts?cursor=%C2%B2"),
    ("GET", "/v1/receipts?cursor=99999999999999999999999"),
    ("GET", "/v1/receipts?cursor=0"),
    ("GET", "/v1/receipts?since=0001-01-01T00:00:00%2B01:00"),
    ("GET", "/v1/receipts?until=9999-12-31T23:59:59-01:00"),
    ("GET", "/v1/receipts?since=2026-01-01T00:00:00%00"),
    ("GET", "/v1/receipts?document_id=" + "x" * 1000 + "%C3%A9" * 20),
    ("GET", "/v1/revisions/99999999999999999999"),
    ("GET", "/v1/documents/x/versions/99999999999999999999"),
]


@pytest.fixture
def hostile_app(tmp_path, db_url, api_profile):
    app = start_keyed_app(api_settings(tmp_path, database_url=db_url), api_profile)
    with app.client:
        yield app
    app.services.close()


def test_hostile_values_answer_4xx_with_a_code(hostile_app):
    wrong = []
    for method, path in HOSTILE_REQUESTS:
        r = hostile_app.client.request(method, path, headers=hostile_app.headers("admin"))
        if not (400 <= r.status_code < 500 and r.headers["content-type"].startswith("application/json")
                and r.json()["error"]["code"]):
            wrong.append((method, path[:80], r.status_code, r.text[:200]))
    assert wrong == []


def test_nul_in_a_key_name_is_refused(hostile_app):
    r = hostile_app.client.post("/v1/keys", headers=hostile_app.headers("admin"),
                                json={"role": "operator", "name": "a\x00b"})
    assert r.status_code == 422 and r.json()["error"]["code"], r.text


def test_a_database_error_inside_a_route_is_answered_in_the_envelope(hostile_app, monkeypatch):
    import receipts.chain

    def boom(*_a, **_k):
        raise DataError("SELECT 1", {}, Exception("PostgreSQL text fields cannot contain NUL (0x00) bytes"))

    monkeypatch.setattr(receipts.chain, "list_receipts", boom)
    r = hostile_app.client.get("/v1/receipts", headers=hostile_app.headers("admin"))
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_value", r.text
    assert "SELECT" not in r.text


def test_an_unexpected_exception_is_a_500_in_the_envelope(tmp_path, api_profile, monkeypatch):
    from fastapi.testclient import TestClient

    import receipts.chain

    app = start_keyed_app(api_settings(tmp_path), api_profile)
    monkeypatch.setattr(receipts.chain, "list_receipts", lambda *a, **k: 1 / 0)
    with TestClient(app.client.app, raise_server_exceptions=False) as client:
        r = client.get("/v1/receipts", headers=app.headers("admin"))
    app.services.close()
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text


def test_translate_db_error_kinds():
    orig = Exception("first line\nSQL text with data")
    assert translate_db_error(DataError("S", {}, orig)).code == "invalid_value"
    assert translate_db_error(IntegrityError("S", {}, orig)).code == "conflict"
    assert translate_db_error(OperationalError("S", {}, orig)).code == "database_unavailable"
    assert translate_db_error(DataError("S", {}, orig)).details["driver_message"] == "first line"


HOSTILE_ARGV = [
    ["receipts", "list", "--cursor", "²"],
    ["receipts", "list", "--cursor", "99999999999999999999999"],
    ["receipts", "list", "--since", "0001-01-01T00:00:00+01:00"],
    ["receipts", "list", "--until", "9999-12-31T23:59:59-01:00"],
    ["receipts", "list", "--document", "a\x00b"],
    ["receipts", "list", "--document", "x", "--version", "99999999999999999999"],
    ["receipts", "show", "a\x00b"],
    ["replay", "a\x00b"],
    ["keys", "revoke", "a\x00b"],
    ["keys", "create", "--role", "operator", "--name", "a\x00b"],
    ["documents", "show", "a\x00b"],
    ["documents", "versions", "a\x00b"],
    ["documents", "show", "x", "--version", "99999999999999999999"],
    ["revisions", "show", "99999999999999999999"],
]


@pytest.mark.parametrize("argv", HOSTILE_ARGV, ids=lambda a: " ".join(a).replace("\x00", "NUL")[:60])
def test_cli_hostile_values_exit_2_with_one_line(settings, monkeypatch, capsys, argv):
    monkeypatch.setenv("RAGBUDGET_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("RAGBUDGET_DATABASE_URL", settings.resolved_database_url)
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse refuses it before any command runs
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.strip()
