"""``ragbudget retrieve`` / ``reindex`` and ``POST /v1/retrieve`` over a fixture corpus and fake embedder."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from app.api.app import create_app
from app.auth import create_key
from app.services import Services
from app.settings import Settings, get_settings
from tests.conftest import run_cli
from tests.retrieval.corpus import FixtureCorpus
from tests.retrieval.fakes import HashingEmbedder

DOCS = {"pump": "The circulation pump is painted red.\n\nIts motor draws 3 kW at full load.",
        "gauge": "Gauge G1 measures loop pressure in bar."}


@pytest.fixture
def stored(engine: Engine, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> HashingEmbedder:
    """Two revisions in the database under test; every Services uses the same fake embedder."""
    fake = HashingEmbedder()
    corpus = FixtureCorpus(engine, fake)
    corpus.commit(DOCS)
    corpus.commit({"pump": "The circulation pump is painted blue."})
    monkeypatch.setattr(Services, "embedder", property(lambda self: fake))
    monkeypatch.setenv("RAGBUDGET_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("RAGBUDGET_DATABASE_URL", settings.resolved_database_url)
    return fake


_run = run_cli


def test_cli_retrieve_json_gives_ranked_hits_at_the_pinned_revision(
        stored: HashingEmbedder, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "retrieve", "red pump", "--k", "2", "--revision", "1", "--json")
    data = json.loads(out)
    assert code == 0 and data["revision"] == 1
    assert data["hits"][0]["document_id"] == "pump" and data["hits"][0]["version"] == 1
    assert "red" in data["hits"][0]["text"]


def test_cli_retrieve_human_output_lists_hits(stored: HashingEmbedder,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "retrieve", "gauge pressure", "--k", "1")
    assert code == 0 and "revision 2" in out and "gauge v1" in out


def test_cli_empty_query_is_an_error_with_nonzero_exit(stored: HashingEmbedder,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "retrieve", "   ")
    assert code == 2 and "empty_query" in err


def test_cli_unknown_revision_is_not_found(stored: HashingEmbedder,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "retrieve", "pump", "--revision", "7", "--json")
    assert code == 3 and json.loads(out)["error"]["code"] == "unknown_revision"


def test_cli_reindex_reports_the_rebuilt_index(stored: HashingEmbedder,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "reindex", "--json")
    data = json.loads(out)
    assert code == 0 and data["action"] == "rebuilt" and data["revision"] == 2 and data["n_vectors"] == 4


@pytest.fixture
def secured(stored: HashingEmbedder, settings: Settings, engine: Engine) -> Iterator[tuple[TestClient, dict]]:  # type: ignore[type-arg]
    conf = get_settings(data_dir=settings.data_dir, database_url=settings.resolved_database_url,
                        auth_enabled=True)
    keys = {role: create_key(engine, role)[1] for role in ("copilot", "operator")}
    services = Services(conf)
    with TestClient(create_app(services=services)) as client:
        yield client, {r: {"Authorization": f"Bearer {k}"} for r, k in keys.items()}
    services.close()


def test_api_copilot_gets_hits_without_text(secured: tuple[TestClient, dict]) -> None:  # type: ignore[type-arg]
    client, headers = secured
    r = client.post("/v1/retrieve", json={"query": "red pump", "k": 3}, headers=headers["copilot"])
    assert r.status_code == 200
    hits = r.json()["hits"]
    assert len(hits) == 2 and all("text" not in h for h in hits)  # 2 chunks live at revision 2
    assert hits[0]["chunk_hash"].startswith("sha256:")


def test_api_operator_gets_chunk_texts(secured: tuple[TestClient, dict]) -> None:  # type: ignore[type-arg]
    client, headers = secured
    r = client.post("/v1/retrieve", json={"query": "red pump", "k": 3, "revision": 1},
                    headers=headers["operator"])
    assert r.status_code == 200 and all(h["text"] for h in r.json()["hits"])


def test_api_scores_round_trip_exactly(secured: tuple[TestClient, dict], stored: HashingEmbedder,  # type: ignore[type-arg]
                                       engine: Engine, settings: Settings) -> None:
    client, headers = secured
    body = client.post("/v1/retrieve", json={"query": "gauge bar", "k": 4},
                       headers=headers["operator"]).json()
    from retrieval.retriever import Retriever

    direct = Retriever(engine, stored, settings.data_dir / "index").retrieve("gauge bar", 4)
    assert [h["score"] for h in body["hits"]] == [h.score for h in direct.hits]


def test_api_requires_a_key(secured: tuple[TestClient, dict]) -> None:  # type: ignore[type-arg]
    client, _ = secured
    assert client.post("/v1/retrieve", json={"query": "pump"}).status_code == 401


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"query": "  "}, 422, "empty_query"),
    ({"query": "pump", "k": 0}, 422, "invalid_k"),
    ({"query": "pump", "k": 10_000}, 422, "invalid_k"),
    ({"query": "pump", "revision": 99}, 404, "unknown_revision"),
    ({"query": "x" * 5000}, 413, "query_too_long"),
])
def test_api_bad_requests_map_to_status_and_code(secured: tuple[TestClient, dict], body: dict,  # type: ignore[type-arg]
                                                 status: int, code: str) -> None:
    client, headers = secured
    r = client.post("/v1/retrieve", json=body, headers=headers["copilot"])
    assert r.status_code == status and r.json()["error"]["code"] == code


def _integers_beyond_2_53(value: object) -> list[int]:
    if isinstance(value, dict):
        return [i for v in value.values() for i in _integers_beyond_2_53(v)]
    if isinstance(value, list):
        return [i for v in value for i in _integers_beyond_2_53(v)]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53 - 1:
        return [value]
    return []


def test_api_chunk_ids_are_decimal_strings_and_no_integer_exceeds_2_53(
        secured: tuple[TestClient, dict], stored: HashingEmbedder, engine: Engine,  # type: ignore[type-arg]
        settings: Settings) -> None:
    """63-bit chunk ids would be rounded by a JavaScript client; they travel as strings."""
    client, headers = secured
    body = client.post("/v1/retrieve", json={"query": "red pump", "k": 3},
                       headers=headers["copilot"]).json()
    from retrieval.retriever import Retriever

    direct = Retriever(engine, stored, settings.data_dir / "index").retrieve("red pump", 3)
    assert [h["chunk_id"] for h in body["hits"]] == [str(h.chunk_id) for h in direct.hits]
    assert any(h.chunk_id > 2**53 for h in direct.hits)  # the fixture's ids really are that large
    assert _integers_beyond_2_53(body) == []


def test_cli_retrieve_json_chunk_ids_are_decimal_strings(stored: HashingEmbedder,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "retrieve", "red pump", "--k", "2", "--json")
    data = json.loads(out)
    assert code == 0 and all(isinstance(h["chunk_id"], str) and h["chunk_id"].isdigit()
                             for h in data["hits"])
    assert _integers_beyond_2_53(data) == []
