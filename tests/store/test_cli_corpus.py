from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli.main import main
from retrieval.corpus import MARKER, deb_name, fetch_postgres_docs
from tests.conftest import CASES, CORPORA


@pytest.fixture
def cli(cli_env, capsys):  # type: ignore[no-untyped-def]
    """``cli(*argv) -> (exit code, parsed --json stdout)`` against the database under test."""

    def run(*argv: str):  # type: ignore[no-untyped-def]
        capsys.readouterr()
        code = main([*argv, "--json"])
        out = capsys.readouterr().out
        return code, json.loads(out) if out.strip() else None

    return run


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "docs"
    (root / "guides").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "guides" / "setup.md").write_text("# Setup\n\nInstall the pump first.")
    (root / "intro.txt").write_text("Welcome. This is the manual.")
    (root / "page.html").write_text("<html><body><p>Hello <b>web</b>.</p></body></html>")
    (root / ".git" / "config").write_text("hidden")
    return root


def test_ingest_uses_paths_relative_to_the_root_as_ids(cli, tree):
    code, out = cli("ingest", str(tree), "--no-embed")
    assert code == 0 and out["revision"] == 1 and out["counts"]["added"] == 3
    assert sorted(r["document_id"] for r in out["results"]) == ["guides/setup.md", "intro.txt", "page.html"]
    code, doc = cli("documents", "show", "page.html")
    assert code == 0 and doc["text"] == "Hello web."


def test_ingest_reports_each_rejected_file_and_exits_non_zero(cli, tree):
    (tree / "empty.txt").write_bytes((CASES / "empty.txt").read_bytes())
    (tree / "blank.txt").write_bytes((CASES / "whitespace_only.txt").read_bytes())
    (tree / "latin1.txt").write_bytes(b"caf\xe9")
    (tree / "report.pdf").write_bytes(b"%PDF-1.4")
    code, out = cli("ingest", str(tree), str(tree / "missing.txt"), "--no-embed")
    assert code == 2 and out["revision"] == 1 and out["counts"]["added"] == 3
    rejected = {r["document_id"]: r["code"] for r in out["results"] if r["status"] == "rejected"}
    assert rejected == {"empty.txt": "empty_content", "blank.txt": "empty_content",
                        "latin1.txt": "invalid_encoding", "report.pdf": "unsupported_type",
                        str(tree / "missing.txt"): "not_found"}
    assert all(r["reason"] for r in out["results"] if r["status"] == "rejected")


def test_reingesting_the_same_tree_is_a_no_op(cli, tree):
    cli("ingest", str(tree), "--no-embed")
    code, out = cli("ingest", str(tree), "--no-embed")
    assert code == 0 and out["revision"] is None and out["counts"]["unchanged"] == 3
    assert len(cli("revisions", "list")[1]) == 1


def test_delete_missing_tombstones_files_that_disappeared_in_the_same_batch(cli, tree):
    cli("ingest", str(tree), "--no-embed")
    (tree / "intro.txt").unlink()
    (tree / "page.html").write_text("<p>Hello again.</p>")
    code, out = cli("ingest", str(tree), "--no-embed", "--delete-missing")
    assert code == 0 and out["revision"] == 2
    assert (out["counts"]["deleted"], out["counts"]["updated"]) == (1, 1)
    _, rev = cli("revisions", "show", "2")
    assert [d["document_id"] for d in rev["documents"]] == ["guides/setup.md", "page.html"]
    _, versions = cli("documents", "versions", "intro.txt")
    assert [v["is_tombstone"] for v in versions] == [False, True]


def test_a_symlink_loop_ingests_each_real_file_once_and_reports_the_rest_skipped(cli, tree, capsys):
    (tree / "guides" / "loop").symlink_to(tree, target_is_directory=True)
    (tree / "setup_link.md").symlink_to(tree / "guides" / "setup.md")
    code, out = cli("ingest", str(tree), "--follow-symlinks", "--no-embed")
    assert code == 0 and out["revision"] == 1
    assert out["counts"]["added"] == 3 and out["counts"]["skipped"] == 2 and out["live_documents"] == 3
    skipped = {r["document_id"]: r["code"] for r in out["results"] if r["status"] == "skipped"}
    assert skipped == {"guides/loop": "symlink_loop", "setup_link.md": "duplicate_file"}
    assert cli("documents", "show", "guides/loop/intro.txt")[0] != 0
    capsys.readouterr()
    assert main(["ingest", str(tree), "--follow-symlinks", "--no-embed"]) == 0
    assert "skipped guides/loop: [symlink_loop]" in capsys.readouterr().out


def test_delete_missing_tombstones_a_document_now_reached_only_as_a_duplicate(cli, tree):
    (tree / "copy.txt").write_text("Welcome. This is the manual.")
    assert cli("ingest", str(tree), "--no-embed")[1]["counts"]["added"] == 4
    (tree / "copy.txt").unlink()
    (tree / "copy.txt").symlink_to(tree / "intro.txt")
    code, out = cli("ingest", str(tree), "--no-embed", "--delete-missing")
    assert code == 0 and out["counts"]["deleted"] == 1 and out["counts"]["skipped"] == 1
    assert {(r["document_id"], r["status"]) for r in out["results"]} >= {("copy.txt", "deleted"),
                                                                          ("copy.txt", "skipped")}


def test_a_single_file_can_take_the_callers_id(cli, tree):
    code, out = cli("ingest", str(tree / "intro.txt"), "--id", "manual/intro", "--no-embed")
    assert code == 0 and out["results"][0]["document_id"] == "manual/intro"


def test_overlap_not_below_size_fails_before_anything_runs(cli, tree, monkeypatch):
    monkeypatch.setenv("RAGBUDGET_CHUNK_OVERLAP_TOKENS", "64")
    code, out = cli("ingest", str(tree), "--no-embed")
    assert code == 2 and out["error"]["code"] == "invalid_config"
    monkeypatch.setenv("RAGBUDGET_CHUNK_OVERLAP_TOKENS", "8")
    assert cli("revisions", "list")[1] == []


def test_revisions_verify_reports_a_consistent_store(cli, tree):
    cli("ingest", str(tree), "--no-embed")
    code, out = cli("revisions", "verify")
    assert code == 0 and out == {"ok": True, "problems": [], "revision": 1}


@pytest.mark.slow
@pytest.mark.parametrize("use_dpkg", [True, False])
def test_fetch_unpacks_the_html_pages_flat_and_idempotently(tmp_path, use_dpkg):
    deb = CORPORA / deb_name("15.18")
    if not deb.is_file():
        pytest.skip("corpus .deb not present")
    first = fetch_postgres_docs(tmp_path, "15.18", search_dirs=[CORPORA], use_dpkg=use_dpkg)
    pages = sorted(Path(first.path).iterdir())
    assert first.pages == 1167 and not first.reused
    assert all(p.suffix == ".html" for p in pages if p.name != MARKER)
    assert (Path(first.path) / "sql-select.html").is_file()
    again = fetch_postgres_docs(tmp_path, "15.18", search_dirs=[CORPORA], use_dpkg=use_dpkg)
    assert again.reused and again.path == first.path
    assert not [p for p in (tmp_path / "corpora").iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_fetch_with_a_missing_deb_fails_with_a_code(cli, tmp_path):
    code, out = cli("corpus", "fetch", "postgres-docs", "--version", "15.18",
                    "--deb", str(tmp_path / "no.deb"))
    assert code == 3 and out["error"]["code"] == "corpus_unavailable"
