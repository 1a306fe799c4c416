"""Receipts in RFC 8785 (format version 2): any JCS library reproduces the hash, no integer loses
precision, version-1 receipts still verify, and a stored body that is not its own canonical form is
reported as edited (SQLite and PostgreSQL)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jcs
import pytest
import rfc8785
from sqlalchemy import insert, select

from app.cli.main import main
from foundation.db import WriterLock, read_session, write_transaction
from foundation.errors import InvalidInput
from foundation.hashing import MAX_SAFE_INTEGER
from ragbudget_testing.synthetic_receipts import candidate, sections
from receipts.canonical import canonical_body, stored_form_problem
from receipts.chain import append_receipt, get_receipt, receipt_hash
from receipts.models import ReceiptDocument, ReceiptRow
from receipts.replay import check_chain
from receipts.schema import FORMAT_VERSION, build_receipt_body
from receipts.verify import verify_chain
from retrieval.chunking import chunk_id
from tests.conftest import CASES

REPO = Path(__file__).resolve().parents[2]
V1_FIXTURE = Path(__file__).parent / "data" / "receipts_v1.json"
JS_VERIFIER = Path(__file__).parent / "jcs_verify.js"
NODE_MODULES = REPO / ".node" / "node_modules"


def awkward_sections(question: str = "How do I archive WAL?") -> dict[str, Any]:
    """Sections with what json.dumps and RFC 8785 write differently: real 63-bit chunk ids,
    1200.0, 1e-07, -0.0, non-ASCII text."""
    cands = [candidate(1, "runtime-config-wal.html", 1, 0.8125, chunk_id("runtime-config-wal.html", 1, 3)),
             candidate(2, "continuous-archiving.html", 2, -0.0, chunk_id("continuous-archiving.html", 2, 0))]
    s = sections(question=question + " (Größe, 日本語, 😀)", candidates=cands)
    s["plan"]["budget_ms"] = 1200.0
    s["plan"]["overhead_ms"] = 1e-07
    return s


def unsafe_integers(value: Any, path: str = "") -> list[str]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in unsafe_integers(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in unsafe_integers(v, f"{path}[{i}]")]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SAFE_INTEGER:
        return [path]
    return []


def load_v1_chain(engine: Any) -> list[dict[str, Any]]:
    """Insert the two version-1 receipts written by the code before format version 2, verbatim."""
    data = json.loads(V1_FIXTURE.read_text())
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        s.execute(insert(ReceiptRow), data["receipts"])
        s.execute(insert(ReceiptDocument), data["receipt_documents"])
    return list(data["receipts"])


def _set_body(engine: Any, seq: int, text: str) -> None:
    with write_transaction(engine, WriterLock.RECEIPTS) as s:
        s.scalars(select(ReceiptRow).where(ReceiptRow.seq == seq)).one().body = text


def _stored_text(engine: Any, seq: int) -> str:
    with read_session(engine) as s:
        return str(s.scalar(select(ReceiptRow.body).where(ReceiptRow.seq == seq)))


def test_new_receipt_is_stored_in_rfc8785_form_with_chunk_ids_as_strings(engine):
    stored = append_receipt(engine, build_receipt_body(**awkward_sections()))
    got = get_receipt(engine, stored.id)
    assert got["format_version"] == FORMAT_VERSION == 2
    assert _stored_text(engine, stored.seq).encode("utf-8") == rfc8785.dumps(got)
    assert got["candidates"][0]["chunk_id"] == str(chunk_id("runtime-config-wal.html", 1, 3))
    assert unsafe_integers(got) == []
    assert '"budget_ms":1200,' in _stored_text(engine, stored.seq)
    assert '"overhead_ms":1e-7,' in _stored_text(engine, stored.seq)


def test_second_python_jcs_implementation_reproduces_every_new_hash(engine):
    """``jcs`` (the RFC author's reference code) over the body a JSON reader gets back."""
    ids = [append_receipt(engine, build_receipt_body(**awkward_sections(f"q{i}"))).id for i in range(3)]
    for rid in ids:
        body = get_receipt(engine, rid)
        unhashed = {k: v for k, v in body.items() if k != "hash"}
        assert "sha256:" + hashlib.sha256(jcs.canonicalize(unhashed)).hexdigest() == body["hash"]


def test_node_jcs_implementation_reproduces_every_new_hash(engine, tmp_path):
    """Node's ``canonicalize`` (installed by scripts/test.sh when node and npm are present)."""
    node = shutil.which("node")
    if node is None or not (NODE_MODULES / "canonicalize").is_dir():
        pytest.skip("node or the canonicalize package is not installed (scripts/test.sh installs it)")
    ids = [append_receipt(engine, build_receipt_body(**awkward_sections(f"q{i}"))).id for i in range(3)]
    path = tmp_path / "receipts.json"
    # As an HTTP client receives them: JSON text, parsed by JavaScript's JSON.parse.
    path.write_text(json.dumps([get_receipt(engine, rid) for rid in ids], ensure_ascii=False))
    out = subprocess.run([node, str(JS_VERIFIER), str(path)], capture_output=True, text=True, check=True,
                         env={**os.environ, "NODE_PATH": str(NODE_MODULES)}, timeout=60)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [x["id"] for x in lines] == ids
    assert all(x["match"] and x["unsafe_integers"] == [] for x in lines), lines


def test_shared_jcs_check_prints_match_and_no_unsafe_integer_for_a_new_receipt(engine, settings,
                                                                                 monkeypatch, capsys,
                                                                                 tmp_path):
    script = CASES / "receipts_jcs_check.py"
    if not script.exists():
        pytest.skip("shared cases not present")
    rid = append_receipt(engine, build_receipt_body(**awkward_sections())).id
    monkeypatch.setenv("RAGBUDGET_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("RAGBUDGET_DATABASE_URL", settings.resolved_database_url)
    monkeypatch.setenv("RAGBUDGET_AUTH_ENABLED", "false")
    assert main(["receipts", "show", rid, "--json"]) == 0
    path = tmp_path / "receipt.json"
    path.write_text(capsys.readouterr().out)
    out = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    jcs_line = next(line for line in out.splitlines() if line.startswith("RFC 8785 over JS numbers"))
    assert jcs_line.split()[-1] == "MATCH", out
    assert "0 integers above 2^53" in out


def test_version_1_receipts_still_verify_and_the_chain_runs_across_both_versions(engine):
    v1 = load_v1_chain(engine)
    assert json.loads(v1[0]["body"])["format_version"] == 1
    new = [append_receipt(engine, build_receipt_body(**awkward_sections(f"after {i}"))) for i in range(2)]
    assert new[0].prev_hash == v1[-1]["hash"] and new[0].seq == 3
    report = verify_chain(engine, batch_size=2)
    assert report.ok, report.render()
    assert report.checked == 4
    with read_session(engine) as s:
        row = s.scalars(select(ReceiptRow).where(ReceiptRow.seq == 3)).one()
        s.expunge(row)
    assert all(c.ok for c in check_chain(engine, row, json.loads(row.body)))


def test_edited_version_1_receipt_is_still_located(engine):
    v1 = load_v1_chain(engine)
    append_receipt(engine, build_receipt_body(**sections()))
    body = json.loads(v1[1]["body"])
    body["candidates"][0]["score"] = 0.99
    _set_body(engine, 2, canonical_body(body).decode("utf-8"))
    assert [(p.kind, p.seq) for p in verify_chain(engine).problems] == [("edited", 2)]


@pytest.mark.parametrize("version", [1, 2])
def test_pretty_printed_body_is_reported_edited(engine, version):
    if version == 1:
        load_v1_chain(engine)
        seq = 2
    else:
        seq = append_receipt(engine, build_receipt_body(**awkward_sections())).seq
    body = json.loads(_stored_text(engine, seq))
    _set_body(engine, seq, json.dumps(body, indent=2, sort_keys=True, ensure_ascii=False))
    assert receipt_hash(body) == body["hash"]  # the content is untouched: only the bytes changed
    problems = verify_chain(engine).problems
    assert [(p.kind, p.seq) for p in problems] == [("edited", seq)]
    assert "not canonical" in problems[0].detail


@pytest.mark.parametrize("version", [1, 2])
def test_body_with_a_duplicated_key_is_reported_edited(engine, version):
    if version == 1:
        load_v1_chain(engine)
        seq = 2
    else:
        seq = append_receipt(engine, build_receipt_body(**awkward_sections())).seq
    text = _stored_text(engine, seq)
    question = json.loads(text)["question"]
    # A second "question" key before the real one: readers that keep the first value see a forged
    # question, Python keeps the last one, so the hash alone would still verify.
    forged = '{"question":"forged",' + text[1:]
    _set_body(engine, seq, forged)
    assert json.loads(forged)["question"] == question
    problems = verify_chain(engine).problems
    assert [(p.kind, p.seq) for p in problems] == [("edited", seq)]
    assert "'question' twice" in problems[0].detail


def test_canonical_body_text_has_no_stored_form_problem():
    body = build_receipt_body(**awkward_sections())
    body.update(id="rcpt_x", seq=1, created_at="2025-01-01T00:00:00.000000+00:00", prev_hash="p")
    body["hash"] = receipt_hash(body)
    assert stored_form_problem(canonical_body(body).decode("utf-8")) is None
    assert stored_form_problem(json.dumps(body)) is not None  # json.dumps is not RFC 8785


def test_version_2_body_refuses_an_integer_beyond_2_53():
    s = awkward_sections()
    s["extra"] = {"big": 2**53}
    with pytest.raises(InvalidInput, match="beyond 2\\*\\*53") as err:
        build_receipt_body(**s)
    assert err.value.details["field"] == "body.extra.big"


def test_version_2_body_refuses_a_seed_beyond_2_53():
    s = copy.deepcopy(awkward_sections())
    s["generator"]["params"]["seed"] = 2**62
    with pytest.raises(InvalidInput, match="beyond 2\\*\\*53"):
        build_receipt_body(**s)
