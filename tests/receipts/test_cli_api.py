"""The receipts CLI commands and HTTP routes over a small store (SQLite and PostgreSQL)."""

import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

import app.answering.receipt_wiring as wiring
from app.api.app import create_app
from app.auth import create_key
from app.cli.main import main
from app.services import Services
from app.settings import get_settings
from foundation.db import WriterLock, write_transaction
from ragbudget_testing.synthetic_receipts import (
    FakeRetriever,
    answer_body,
    make_revision_1,
    make_revisions_2_3,
    rebuild_prompt,
)
from receipts.chain import append_receipt
from receipts.models import ReceiptRow


@pytest.fixture
def store(engine, settings, monkeypatch):
    """Two answers at revision 1, then revisions 2 and 3; the CLI/API see a fake retriever."""
    make_revision_1(engine)
    retriever = FakeRetriever(engine)
    ids = [append_receipt(engine, answer_body(retriever, question=q)).id
           for q in ("how does WAL archiving work", "what does pg_dump write")]
    make_revisions_2_3(engine)
    monkeypatch.setattr(Services, "retriever", property(lambda self: FakeRetriever(self.engine)))
    monkeypatch.setattr(wiring, "replay_hooks", lambda services: (rebuild_prompt, None))
    monkeypatch.setenv("RAGBUDGET_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("RAGBUDGET_DATABASE_URL", settings.resolved_database_url)
    monkeypatch.setenv("RAGBUDGET_AUTH_ENABLED", "false")
    return ids


def _run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_cli_verify_ok_exits_zero(store, capsys):
    code, out = _run(capsys, "receipts", "verify", "--json")
    assert code == 0 and json.loads(out)["checked"] == 2


def test_cli_verify_tampered_exits_nonzero_and_locates(store, engine, capsys):
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        s.execute(update(ReceiptRow).where(ReceiptRow.seq == 2).values(hash="sha256:" + "f" * 64))
    code, out = _run(capsys, "receipts", "verify", "--json")
    assert code == 4
    assert [(p["kind"], p["seq"]) for p in json.loads(out)["problems"]] == [("hash_mismatch", 2)]


def test_cli_list_filters_by_document(store, capsys):
    code, out = _run(capsys, "receipts", "list", "--json", "--document", "doc-zzz")
    assert code == 0 and json.loads(out) == {"receipts": [], "next_cursor": None}


def test_cli_list_filters_by_budget_adherence(store, capsys):
    _, within = _run(capsys, "receipts", "list", "--json", "--within-budget", "yes")
    _, over = _run(capsys, "receipts", "list", "--json", "--within-budget", "no")
    assert len(json.loads(within)["receipts"]) == 2 and json.loads(over)["receipts"] == []


def test_cli_list_pages(store, capsys):
    code, out = _run(capsys, "receipts", "list", "--json", "--limit", "1")
    page = json.loads(out)
    assert [r["id"] for r in page["receipts"]] == [store[1]] and page["next_cursor"] == "2"


def test_cli_show_includes_freshness(store, capsys):
    code, out = _run(capsys, "receipts", "show", store[0], "--json")
    data = json.loads(out)
    assert code == 0 and data["receipt"]["id"] == store[0]
    assert data["freshness"]["latest_revision"] == 3


def test_cli_show_unknown_receipt_exits_3(store, capsys):
    assert main(["receipts", "show", "rcpt_nope"]) == 3


def test_cli_replay_ok_exits_zero(store, capsys):
    code, out = _run(capsys, "replay", store[0], "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"]
    assert {c["name"]: c["status"] for c in report["checks"]}["prompt"] == "ok"


def test_cli_replay_failed_check_exits_nonzero(store, monkeypatch, capsys):
    wrong_prompt = (lambda b, h: ("sha256:" + "0" * 64, 1), None)
    monkeypatch.setattr(wiring, "replay_hooks", lambda services: wrong_prompt)
    code, out = _run(capsys, "replay", store[0])
    assert code == 4 and "FAILED" in out and "prompt" in out


def test_cli_replay_regenerate_without_hook_is_skipped(store, capsys):
    code, out = _run(capsys, "replay", store[0], "--regenerate", "--json")
    checks = {c["name"]: c["status"] for c in json.loads(out)["checks"]}
    assert code == 0 and checks["regenerate"] == "skipped"


@pytest.fixture
def client(store, settings):
    services = Services(settings)
    with TestClient(create_app(services=services)) as c:
        yield c
    services.close()


def test_api_lists_with_filters_and_paging(client, store):
    first = client.get("/v1/receipts", params={"limit": 1}).json()
    second = client.get("/v1/receipts", params={"limit": 1, "cursor": first["next_cursor"]}).json()
    assert [r["id"] for r in first["receipts"] + second["receipts"]] == store[::-1]
    assert second["next_cursor"] is None
    assert client.get("/v1/receipts", params={"status": "failed"}).json()["receipts"] == []


def test_api_bad_time_is_422(client):
    r = client.get("/v1/receipts", params={"since": "yesterday"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_input"


def test_api_get_receipt_with_freshness(client, store):
    data = client.get(f"/v1/receipts/{store[0]}").json()
    assert data["receipt"]["id"] == store[0]
    assert data["freshness"]["receipt_revision"] == 1


def test_api_unknown_receipt_is_404(client):
    r = client.get("/v1/receipts/rcpt_nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_receipt"


def test_api_replay_reports_every_check(client, store):
    r = client.post(f"/v1/receipts/{store[0]}/replay", json={"regenerate": False})
    assert r.status_code == 200 and r.json()["ok"] is True
    assert {c["name"] for c in r.json()["checks"]} >= {"receipt_hash", "retrieval", "prompt"}


def test_api_receipts_need_the_operator_role(store, settings, engine):
    secured = get_settings(data_dir=settings.data_dir, database_url=settings.resolved_database_url,
                           auth_enabled=True)
    _, copilot = create_key(engine, "copilot")
    _, operator = create_key(engine, "operator")
    services = Services(secured)
    with TestClient(create_app(services=services)) as c:
        assert c.get("/v1/receipts").status_code == 401
        assert c.get("/v1/receipts", headers={"Authorization": f"Bearer {copilot}"}).status_code == 403
        assert c.post(f"/v1/receipts/{store[0]}/replay",
                      headers={"Authorization": f"Bearer {copilot}"}).status_code == 403
        assert c.get(f"/v1/receipts/{store[0]}",
                     headers={"Authorization": f"Bearer {operator}"}).status_code == 200
    services.close()
