"""Two ``ragbudget serve`` replicas on separate hosts (network namespaces) share one PostgreSQL
database: one receipt chain under concurrent answers on both, API keys (a revocation through
one is refused by the other on its next request), the corpus, and latency profiles; each
replica's online correction is its own (docs/deployment.md says why).

The replicas are real ``ragbudget serve`` processes with the packaged models and a slice of
the real corpus (:mod:`tests.fleet.replicas`); answers ask for two chunks at most and two new
tokens, because the store is under test, not the model.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, select

from receipts.chain import GENESIS
from receipts.models import ReceiptRow
from tests.answer.conftest import DEB, HTML
from tests.fleet.conftest import require_netns
from tests.fleet.replicas import ASK, Fleet, Replica, cli, replica_fleet

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

PAGES = ["backup-dump.html", "sql-vacuum.html"]
QUESTIONS = ["How do I dump a database with pg_dump?", "What does VACUUM FULL do?",
             "How do I restore a dump with psql?", "When should I run VACUUM ANALYZE?"]
CLIENTS = 8
ANSWERS_PER_CLIENT = 2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two replicas (a, b) on one cluster with two pages of the PostgreSQL 15.18 docs ingested."""
    require_netns()
    if not DEB.exists() or shutil.which("dpkg-deb") is None:
        pytest.skip("the real corpus or dpkg-deb is not available")
    root = tmp_path_factory.mktemp("fleet")
    subprocess.run(["dpkg-deb", "-x", str(DEB), str(root / "deb")], check=True)
    pages = root / "pages"
    pages.mkdir()
    for page in PAGES:
        shutil.copy(root / "deb" / HTML / page, pages / page)
    with replica_fleet(root, [pages / p for p in PAGES], count=2) as running:
        yield running


def answer(replica: Replica, key: str, question: str, client: httpx.Client | None = None) -> dict[str, Any]:
    """``POST /v1/answer`` on ``replica``; the answer's JSON (asserts 200 and a written receipt)."""
    c = client or httpx.Client(timeout=300)
    r = c.post(f"{replica.base_url}/v1/answer", json={"question": question, **ASK},
               headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, (replica.name, r.text, replica.log_tail())
    body = r.json()
    assert body["status"] == "ok" and body["receipt_status"] == "written", body
    return dict(body)


def new_key(fleet: Fleet, through: Replica, role: str = "copilot") -> dict[str, Any]:
    """A key created with ``POST /v1/keys`` on ``through`` (admin); ``{"id", "key", ...}``."""
    r = httpx.post(f"{through.base_url}/v1/keys", json={"role": role, "name": f"made on {through.name}"},
                   headers=fleet.headers(), timeout=60)
    assert r.status_code == 201, r.text
    return dict(r.json())


def chain_rows(fleet: Fleet) -> list[tuple[int, str, str, str]]:
    """``(seq, id, prev_hash, hash)`` of every receipt, in chain order, read straight from the table."""
    engine = create_engine(fleet.database_url)
    try:
        with engine.connect() as c:
            return [tuple(r) for r in c.execute(select(ReceiptRow.seq, ReceiptRow.id, ReceiptRow.prev_hash,
                                                       ReceiptRow.hash).order_by(ReceiptRow.seq))]
    finally:
        engine.dispose()


def test_concurrent_answers_on_both_replicas_make_one_chain(fleet: Fleet) -> None:
    """8 clients, half on each replica, each with a key made through the other replica: every
    answer's receipt is in one chain (seq 1..N, each receipt pointing at the one before) that
    ``ragbudget receipts verify`` accepts."""
    a, b = fleet.replicas
    keys = [new_key(fleet, b if i % 2 == 0 else a)["key"] for i in range(CLIENTS)]

    def client(i: int) -> list[tuple[str, str]]:
        replica = a if i % 2 == 0 else b
        with httpx.Client(timeout=300) as c:
            asked = [QUESTIONS[(i + j) % len(QUESTIONS)] for j in range(ANSWERS_PER_CLIENT)]
            return [(replica.name, answer(replica, keys[i], q, c)["receipt_id"]) for q in asked]

    before = {row[1] for row in chain_rows(fleet)}
    with ThreadPoolExecutor(CLIENTS) as pool:
        made = [rid for result in pool.map(client, range(CLIENTS)) for rid in result]
    assert len(made) == CLIENTS * ANSWERS_PER_CLIENT
    assert {name for name, _ in made} == {"a", "b"}

    rows = chain_rows(fleet)
    assert [seq for seq, *_ in rows] == list(range(1, len(rows) + 1))  # no gap
    prev = GENESIS
    for seq, rid, prev_hash, digest in rows:  # no fork: each receipt extends the one before
        assert prev_hash == prev, f"receipt {seq} ({rid}) does not point at receipt {seq - 1}"
        prev = digest
    ids = [rid for _, rid, *_ in rows]
    assert len(set(ids)) == len(ids)
    assert {rid for _, rid in made} == set(ids) - before  # every answer's receipt, and only those

    out = cli(fleet.env, "receipts", "verify", "--json", "--expect-head", prev)
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["checked"] == len(rows), report


@pytest.mark.parametrize("revoke_on", [0, 1])
def test_a_key_revoked_through_one_replica_is_refused_by_the_other_on_its_next_request(
        fleet: Fleet, revoke_on: int) -> None:
    here, there = fleet.replicas[revoke_on], fleet.replicas[1 - revoke_on]
    made = new_key(fleet, here)
    auth = {"Authorization": f"Bearer {made['key']}"}
    assert httpx.get(f"{there.base_url}/v1/revisions", headers=auth, timeout=60).status_code == 200
    r = httpx.delete(f"{here.base_url}/v1/keys/{made['id']}", headers=fleet.headers(), timeout=60)
    assert r.status_code == 204, r.text
    refused = httpx.get(f"{there.base_url}/v1/revisions", headers=auth, timeout=60)
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["code"] == "unauthenticated"
    assert httpx.get(f"{here.base_url}/v1/revisions", headers=auth, timeout=60).status_code == 401


def test_a_document_ingested_through_one_replica_is_retrieved_by_the_other(fleet: Fleet) -> None:
    a, b = fleet.replicas
    text = "Replica sentinel: the pg_dump archive of the fleet is kept on tape drive ultramarine."
    r = httpx.post(f"{a.base_url}/v1/documents", json={"id": "fleet-sentinel.txt", "text": text},
                   headers=fleet.headers(), timeout=300)
    assert r.status_code == 201, r.text
    revision = r.json()["revision"]
    found = httpx.post(f"{b.base_url}/v1/retrieve", json={"query": "Which tape drive keeps the pg_dump "
                                                          "archive of the fleet?", "k": 1},
                       headers=fleet.headers(), timeout=300)
    assert found.status_code == 200, found.text
    body = found.json()
    assert body["revision"] == revision
    assert body["hits"][0]["document_id"] == "fleet-sentinel.txt"


def profile_of(fleet: Fleet, replica: Replica, profile_id: str) -> dict[str, Any]:
    """``GET /v1/latency/profiles/{id}`` on ``replica`` (no samples): the profile and the online
    correction this replica applies to it now."""
    r = httpx.get(f"{replica.base_url}/v1/latency/profiles/{profile_id}", params={"samples": "false"},
                  headers=fleet.headers(), timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_each_replica_learns_its_own_online_correction(fleet: Fleet) -> None:
    """Answers on replica a feed a's correction only: b's, for the same profile, does not move."""
    a, b = fleet.replicas
    first = answer(a, fleet.admin_key, QUESTIONS[0])
    profile_id = first["predicted"]["profile_id"]
    n_a = profile_of(fleet, a, profile_id)["correction"]["n"]
    n_b = profile_of(fleet, b, profile_id)["correction"]["n"]
    for q in QUESTIONS[1:3]:
        assert answer(a, fleet.admin_key, q)["predicted"]["profile_id"] == profile_id
    assert profile_of(fleet, a, profile_id)["correction"]["n"] == min(n_a + 2, profile_of(
        fleet, a, profile_id)["correction"]["window"])
    assert profile_of(fleet, b, profile_id)["correction"]["n"] == n_b


def test_a_profile_stored_on_one_host_is_used_by_every_replica_on_its_next_answer(fleet: Fleet) -> None:
    """A fitted profile for the replicas' generator, saved as ``ragbudget calibrate`` saves it (from
    this host, into the shared database), replaces the prior on both replicas' next answers."""
    from app.profile_store import save_profile
    from latency_model.calibration import IDENTITY_KEYS, calibrate
    from latency_model.grid import quick_grid
    from tests.latency_model.conftest import FakeTimer, no_cpu_probe

    a, b = fleet.replicas
    before = [answer(r, fleet.admin_key, QUESTIONS[3])["predicted"] for r in (a, b)]
    assert before[0]["profile_id"] == before[1]["profile_id"]
    if before[0]["profile_source"] == "fitted":
        pytest.fail("the replicas started with a fitted profile; this test needs them on the prior")
    in_force = profile_of(fleet, a, before[0]["profile_id"])
    identity = {k: in_force[k] for k in IDENTITY_KEYS}
    fitted = calibrate(FakeTimer(identity=identity), grid=quick_grid(2048, [200]), seed=5,
                       progress=False, cpu_probe=no_cpu_probe)
    engine = create_engine(fleet.database_url)
    try:
        save_profile(engine, Path(fleet.env["RAGBUDGET_DATA_DIR"]), fitted)
    finally:
        engine.dispose()
    after = [answer(r, fleet.admin_key, QUESTIONS[3])["predicted"] for r in (a, b)]
    assert [p["profile_id"] for p in after] == [fitted.id, fitted.id]
    assert [p["profile_source"] for p in after] == ["fitted", "fitted"]
