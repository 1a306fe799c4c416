from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.auth import create_key


@pytest.fixture
def client(store_settings, services_factory):  # type: ignore[no-untyped-def]
    with TestClient(create_app(services=services_factory(store_settings))) as c:
        yield c


def test_post_adds_a_document_and_makes_a_revision(client):
    r = client.post("/v1/documents", json={"id": "guides/setup.md", "text": "Install it.", "kind": "md",
                                           "metadata": {"team": "ops"}})
    assert r.status_code == 201
    assert r.json()["status"] == "added" and r.json()["revision"] == 1 and r.json()["version"] == 1
    doc = client.get("/v1/documents/guides/setup.md").json()
    assert doc["current"]["text"] == "Install it." and doc["current"]["metadata"] == {"team": "ops"}


def test_posting_the_same_text_again_is_unchanged_with_no_revision(client):
    client.post("/v1/documents", json={"id": "a", "text": "Same."})
    r = client.post("/v1/documents", json={"id": "a", "text": "Same."})
    assert r.status_code == 200 and r.json()["status"] == "unchanged" and r.json()["revision"] is None
    assert client.get("/v1/revisions").json()["latest"] == 1


def test_versions_of_an_id_with_slashes_stay_readable_after_update_and_delete(client):
    client.post("/v1/documents", json={"id": "a/b/c.txt", "text": "One."})
    client.post("/v1/documents", json={"id": "a/b/c.txt", "text": "Two."})
    r = client.delete("/v1/documents/a/b/c.txt")
    assert r.status_code == 200 and r.json()["status"] == "deleted" and r.json()["revision"] == 3
    versions = client.get("/v1/documents/a/b/c.txt/versions").json()
    assert [(v["version"], v["is_tombstone"]) for v in versions] == [(1, False), (2, False), (3, True)]
    assert client.get("/v1/documents/a/b/c.txt/versions/1").json()["text"] == "One."
    doc = client.get("/v1/documents/a/b/c.txt").json()
    assert doc["is_deleted"] and doc["current"] is None


def test_revision_detail_lists_its_live_documents(client):
    client.post("/v1/documents", json={"id": "x", "text": "X."})
    client.post("/v1/documents", json={"id": "y", "text": "Y."})
    client.delete("/v1/documents/x")
    r1 = client.get("/v1/revisions/2").json()
    assert [d["document_id"] for d in r1["documents"]] == ["x", "y"]
    assert [d["document_id"] for d in client.get("/v1/revisions/3").json()["documents"]] == ["y"]
    page = client.get("/v1/revisions", params={"limit": 2}).json()
    assert page["latest"] == 3 and [r["number"] for r in page["revisions"]] == [3, 2]


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"id": "e", "text": ""}, 422, "empty_content"),
    ({"id": "e", "text": " \n\t\u3000"}, 422, "empty_content"),
    ({"id": "e", "text": "\ufeff\u200b\u200d"}, 422, "empty_content"),
    ({"id": "e", "text": "nul\u0000byte"}, 422, "invalid_encoding"),
    ({"id": "e", "text": "x", "kind": "pdf"}, 422, "invalid_request"),
    ({"id": "", "text": "x"}, 422, "invalid_document_id"),
    ({"id": "e", "text": "x", "extra": 1}, 422, "invalid_request"),
    ({"id": "e\n", "text": "x"}, 422, "invalid_document_id"),
])
def test_bad_documents_get_a_specific_code_and_write_nothing(client, body, status, code):
    r = client.post("/v1/documents", json=body)
    assert r.status_code == status and r.json()["error"]["code"] == code
    assert client.get("/v1/revisions").json()["latest"] == 0


def test_a_document_over_the_size_limit_is_413(store_settings, services_factory):
    settings = store_settings.model_copy(update={"max_document_bytes": 100})
    with TestClient(create_app(services=services_factory(settings))) as c:
        r = c.post("/v1/documents", json={"id": "big", "text": "x" * 101})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"


def test_not_found_routes_are_404_with_codes(client):
    client.post("/v1/documents", json={"id": "a", "text": "A."})
    assert client.get("/v1/documents/nope").json()["error"]["code"] == "unknown_document"
    assert client.get("/v1/documents/a/versions/9").json()["error"]["code"] == "unknown_version"
    assert client.get("/v1/revisions/9").json()["error"]["code"] == "unknown_revision"
    r = client.delete("/v1/documents/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_document"


def test_roles_guard_the_routes(store_settings, services_factory, engine):
    settings = store_settings.model_copy(update={"auth_enabled": True})
    keys = {role: {"Authorization": f"Bearer {create_key(engine, role)[1]}"}
            for role in ("copilot", "operator", "admin")}
    with TestClient(create_app(services=services_factory(settings))) as c:
        assert c.post("/v1/documents", json={"id": "a", "text": "A."}).status_code == 401
        assert c.post("/v1/documents", json={"id": "a", "text": "A."},
                      headers=keys["operator"]).status_code == 403
        assert c.post("/v1/documents", json={"id": "a", "text": "A."},
                      headers=keys["admin"]).status_code == 201
        assert c.get("/v1/documents/a", headers=keys["copilot"]).status_code == 403
        assert c.get("/v1/documents/a", headers=keys["operator"]).status_code == 200
        assert c.get("/v1/revisions/1", headers=keys["copilot"]).status_code == 200
        assert c.delete("/v1/documents/a", headers=keys["operator"]).status_code == 403
