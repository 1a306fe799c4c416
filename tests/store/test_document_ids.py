"""Document ids: the grammar (each rule by name), NFC, the byte limit on every backend, one bad file
never sinking a batch, and every valid id reachable over REST from curl, httpx and requests."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import unicodedata
from urllib.parse import quote

import httpx
import pytest
import requests
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.cli.main import main
from foundation.errors import InvalidDocumentId
from retrieval.document_ids import MAX_DOCUMENT_ID_BYTES, RULES, check_document_id
from retrieval.store import IngestItem
from tests.conftest import CASES

CJK_1000 = "docs/" + "".join(chr(0x4E00 + (i * 7919) % 20902) for i in range(995))  # 2990 bytes


@pytest.mark.parametrize(("document_id", "rule"), [
    ("", "empty"),
    ("\udcffname.txt", "not_unicode"),
    ("a" * (MAX_DOCUMENT_ID_BYTES + 1), "too_long"),
    (CJK_1000, "too_long"),
    (" guide.md", "surrounding_whitespace"),
    ("guide.md\n", "surrounding_whitespace"),
    ("guide\x07.md", "control_character"),
    ("invoice\u202egnp.exe", "format_character"),
    ("BGWORKER_\u200bDATABASE", "format_character"),
    ("line\u2028break", "line_separator"),
    ("para\u2029break", "line_separator"),
    ("/etc/guide.md", "leading_slash"),
    ("guides//setup.md", "empty_segment"),
    ("guides/", "empty_segment"),
    ("guides/./setup.md", "dot_segment"),
    ("guides/../secret.md", "dot_segment"),
    ("..", "dot_segment"),
])
def test_each_broken_rule_is_named_in_the_error(document_id: str, rule: str) -> None:
    with pytest.raises(InvalidDocumentId) as err:
        check_document_id(document_id)
    assert err.value.code == "invalid_document_id" and err.value.details["rule"] == rule
    assert f"(rule {rule})" in err.value.message and rule in RULES


@pytest.mark.parametrize("document_id", [
    "runbooks/versions", "runbooks/versions/2", "a b/c?d#e%f&g+h.md", "v1.2/..hidden/x..y", "файл/文書.md",
    "🧯 fire drill.md", "a" * MAX_DOCUMENT_ID_BYTES, "文" * (MAX_DOCUMENT_ID_BYTES // 3),
])
def test_ordinary_ids_are_valid_and_kept_as_given(document_id: str) -> None:
    assert check_document_id(document_id) == document_id


def test_ids_are_nfc_normalised() -> None:
    nfd = unicodedata.normalize("NFD", "notes/café-hours.md")
    assert nfd != "notes/café-hours.md" and check_document_id(nfd) == "notes/café-hours.md"


def test_bad_ids_are_rejected_on_their_own_and_the_rest_of_the_batch_commits(engine, ingest) -> None:
    longest = "文" * (MAX_DOCUMENT_ID_BYTES // 3)
    report = ingest([IngestItem("good.md", text="Fine."), IngestItem(CJK_1000, text="Slots keep WAL."),
                     IngestItem("a/../b", text="x"), IngestItem("a\u202eb", text="x"),
                     IngestItem(longest, text="The longest id every backend indexes.")])
    assert [(r.status, r.code) for r in report.results] == [
        ("added", None), ("rejected", "invalid_document_id"), ("rejected", "invalid_document_id"),
        ("rejected", "invalid_document_id"), ("added", None)]
    assert "(rule too_long)" in str(report.results[1].reason)
    assert report.revision == 1 and report.live_documents == 2


def test_an_nfd_spelling_of_a_stored_id_is_the_same_document(engine, ingest) -> None:
    nfc = "notes/café-hours.md"
    ingest([IngestItem(nfc, text="The café opens at 8.")])
    again = ingest([IngestItem(unicodedata.normalize("NFD", nfc), text="The café opens at 8.")])
    assert [(r.document_id, r.status) for r in again.results] == [(nfc, "unchanged")]
    assert again.revision is None
    gone = ingest([], delete_ids=[unicodedata.normalize("NFD", nfc)])
    assert [(r.document_id, r.status) for r in gone.results] == [(nfc, "deleted")]


# --- the CLI: files with bad names, NFC/NFD folders ----------------------------------------------------

@pytest.fixture
def cli(cli_env, capsys):  # type: ignore[no-untyped-def]
    """``cli(*argv) -> (exit code, stdout)`` against the database under test."""

    def run(*argv: str):  # type: ignore[no-untyped-def]
        capsys.readouterr()
        code = main([*argv])
        return code, capsys.readouterr().out

    return run


def test_a_file_name_that_is_not_utf8_is_rejected_alone_and_the_good_files_are_ingested(cli, tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    (root / "good.txt").write_text("Replication slots keep WAL.")
    (root / "undecodable.txt").write_bytes(b"caf\xe9 latin-1 bytes")
    bad_name = os.fsdecode(b"r\xe9sum\xe9.txt")
    (root / bad_name).write_text("A name in Latin-1 bytes.")
    code, out = cli("ingest", str(root), "--no-embed", "--json")
    data = json.loads(out)
    assert code == 2 and data["revision"] == 1 and data["counts"]["added"] == 1
    by_id = {r["document_id"]: r for r in data["results"]}
    assert by_id["good.txt"]["status"] == "added"
    assert by_id["undecodable.txt"]["code"] == "invalid_encoding"
    assert by_id["r\\xe9sum\\xe9.txt"]["code"] == "invalid_document_id"
    assert "(rule not_unicode)" in by_id["r\\xe9sum\\xe9.txt"]["reason"]
    code, text = cli("ingest", str(root), "--no-embed")
    assert code == 2 and "rejected r\\xe9sum\\xe9.txt: [invalid_document_id]" in text


def test_a_folder_renamed_from_nfc_to_nfd_names_is_unchanged(cli, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    nfc = unicodedata.normalize("NFC", "café-hours.md")
    (notes / nfc).write_text("The café is open from 8 to 18 on weekdays.\n")
    code, out = cli("ingest", str(notes), "--no-embed", "--json")
    assert code == 0 and json.loads(out)["revision"] == 1
    (notes / nfc).rename(notes / unicodedata.normalize("NFD", nfc))
    code, out = cli("ingest", str(notes), "--no-embed", "--delete-missing", "--json")
    data = json.loads(out)
    assert code == 0 and data["revision"] is None
    assert [(r["document_id"], r["status"]) for r in data["results"]] == [(nfc, "unchanged")]


def test_the_cli_refuses_a_bad_id_with_exit_2_naming_the_rule(cli, tmp_path):
    page = tmp_path / "page.txt"
    page.write_text("Replication slots keep WAL until the standby has received it.\n")
    # An id given with --id is an argument: refused before anything is read or written.
    code, out = cli("ingest", str(page), "--id", CJK_1000, "--no-embed", "--json")
    error = json.loads(out)["error"]
    assert code == 2 and error["code"] == "invalid_document_id"
    assert error["details"]["rule"] == "too_long" and "(rule too_long)" in error["message"]
    code, out = cli("revisions", "--json")
    assert code == 0 and json.loads(out) == []


# --- REST: every valid id, from curl, httpx and requests --------------------------------------------

ROUTE_WORD_IDS = [json.loads((CASES / "ingest" / "id_ending_in_versions.json").read_text())["id"],
                  "runbooks/versions/2", "a b/c?d#e%f&g+h.md", "файл/文書.md", "🧯 fire drill.md"]


@pytest.fixture
def server(store_settings, services_factory):  # type: ignore[no-untyped-def]
    """A real HTTP server (uvicorn in a thread) on a free local port; yields its base URL."""
    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(services=services_factory(store_settings)), host="127.0.0.1",
                            port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


def _curl(method: str, url: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    out = subprocess.run(["curl", "-s", "-X", method, "-w", "\n%{http_code}", url], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    body, _, status = out.rpartition("\n")
    return int(status), json.loads(body)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_every_valid_id_is_read_listed_versioned_and_deleted_with_curl_httpx_and_requests(server):
    clients = {
        "httpx": lambda m, path, params: (lambda r: (r.status_code, r.json()))(
            httpx.request(m, server + path, params=params, timeout=30)),
        "requests": lambda m, path, params: (lambda r: (r.status_code, r.json()))(
            requests.request(m, server + path, params=params, timeout=30)),
        "curl": lambda m, path, params: _curl(m, server + path + "?id=" + quote(params["id"], safe="")),
    }
    for name, call in clients.items():
        for doc_id in ROUTE_WORD_IDS:
            text = f"{name} reads {doc_id}."
            r = httpx.post(server + "/v1/documents", json={"id": doc_id, "text": text}, timeout=30)
            assert r.status_code == 201, r.text
            status, body = call("GET", "/v1/document", {"id": doc_id})
            assert status == 200 and body["id"] == doc_id and body["current"]["text"] == text
            status, body = call("GET", "/v1/document/versions", {"id": doc_id})
            assert status == 200 and [v["document_id"] for v in body] == [doc_id] * len(body)
            status, body = call("GET", f"/v1/document/versions/{len(body)}", {"id": doc_id})
            assert status == 200 and body["text"] == text
            status, body = call("DELETE", "/v1/document", {"id": doc_id})
            assert status == 200 and body["status"] == "deleted" and body["document_id"] == doc_id
    listed = {d["document_id"] for d in httpx.get(server + "/v1/revisions/1", timeout=30).json()["documents"]}
    assert listed == {ROUTE_WORD_IDS[0]}


def test_the_route_word_id_through_the_path_form_reaches_the_versions_route_not_the_document(
        store_settings, services_factory):  # type: ignore[no-untyped-def]
    with TestClient(create_app(services=services_factory(store_settings))) as client:
        client.post("/v1/documents", json={"id": "runbooks", "text": "Index of runbooks."})
        client.post("/v1/documents", json={"id": "runbooks/versions", "text": "Restart the replica."})
        assert client.get("/v1/documents/runbooks/versions").json()[0]["document_id"] == "runbooks"
        doc = client.get("/v1/document", params={"id": "runbooks/versions"}).json()
        assert doc["current"]["text"] == "Restart the replica."


def test_an_invalid_id_over_rest_is_422_naming_the_rule(store_settings, services_factory):  # type: ignore[no-untyped-def]
    with TestClient(create_app(services=services_factory(store_settings))) as client:
        r = client.post("/v1/documents", json={"id": CJK_1000, "text": "Slots keep WAL."})
        err = r.json()["error"]
        assert r.status_code == 422 and err["code"] == "invalid_document_id"
        assert err["details"]["rule"] == "too_long" and err["details"]["limit_bytes"] == MAX_DOCUMENT_ID_BYTES
        assert client.get("/v1/revisions").json()["latest"] == 0


def test_every_valid_id_is_read_and_deleted_from_a_browser(server):
    """Headless Chromium (Debian's chromium + chromium-driver, as the console's browser tests use):
    the address bar reads, and a console page's ``fetch`` deletes, by the percent-encoded ``id`` parameter."""
    from tests.ui.test_browser import CHROMEDRIVER, CHROMIUM, _skip_or_fail, _unavailable

    reason = _unavailable()
    if reason:
        _skip_or_fail(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    try:
        for doc_id in ROUTE_WORD_IDS:
            httpx.post(server + "/v1/documents", json={"id": doc_id, "text": f"Browser reads {doc_id}."},
                       timeout=30)
            url = f"{server}/v1/document?id={quote(doc_id, safe='')}"
            driver.get(url)
            body = json.loads(driver.find_element(By.TAG_NAME, "body").text)
            assert body["id"] == doc_id and body["current"]["text"] == f"Browser reads {doc_id}."
            driver.get(f"{server}/v1/document/versions/1?id={quote(doc_id, safe='')}")
            assert json.loads(driver.find_element(By.TAG_NAME, "body").text)["document_id"] == doc_id
            # The fetch runs from a console page (connect-src 'self'); the API's JSON answers
            # carry a policy that lets them load nothing (app/api/security_headers.py).
            driver.get(f"{server}/ui/login")
            status = driver.execute_async_script(
                "const done = arguments[arguments.length - 1];"
                "fetch(arguments[0], {method: 'DELETE'}).then(r => r.json()).then(j => done(j.status));", url)
            assert status == "deleted"
    finally:
        driver.quit()
