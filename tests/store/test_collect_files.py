"""What ``ingest`` collects from the paths it is given: symbolic links out of a directory are
refused unless asked for, non-regular files are named as such, an empty ``--id`` is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.cli.main import main
from app.ingest import collect_files
from foundation.errors import InvalidDocumentId


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for the index")
    (outside / "dir").mkdir()
    (outside / "dir" / "more.txt").write_text("nor this")
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.txt").write_text("a document")
    (root / "link_out.txt").symlink_to(outside / "secret.txt")
    (root / "dir_out").symlink_to(outside / "dir")
    (root / "link_in.txt").symlink_to(root / "a.txt")
    os.mkfifo(root / "pipe.txt")
    return root


def _codes(rejected):
    return {r.document_id: r.code for r in rejected}


def test_symlinks_out_of_the_directory_are_refused_by_default(tree):
    items, rejected = collect_files([tree], 10_000)
    assert sorted(i.document_id for i in items) == ["a.txt", "link_in.txt"]
    assert _codes(rejected) == {"link_out.txt": "symlink_outside", "dir_out": "symlink_outside",
                                "pipe.txt": "not_regular_file"}


def test_follow_symlinks_follows_them(tree):
    items, rejected = collect_files([tree], 10_000, follow_symlinks=True)
    assert sorted(i.document_id for i in items) == ["a.txt", "dir_out/more.txt", "link_in.txt",
                                                    "link_out.txt"]
    assert _codes(rejected) == {"pipe.txt": "not_regular_file"}


def test_a_path_that_is_not_a_regular_file_is_named_as_such(tmp_path):
    _, rejected = collect_files([Path("/dev/zero"), tmp_path / "missing.txt"], 10_000)
    assert [r.code for r in rejected] == ["not_regular_file", "not_found"]
    assert "not a regular file" in rejected[0].reason


def test_an_empty_id_is_refused(tree):
    with pytest.raises(InvalidDocumentId):
        collect_files([tree / "a.txt"], 10_000, document_id="")


def test_cli_ingest_with_an_empty_id_exits_2(tree, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAGBUDGET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("RAGBUDGET_DATABASE_URL", f"sqlite:///{tmp_path / 'db.sqlite'}")
    assert main(["ingest", str(tree / "a.txt"), "--id", "", "--no-embed"]) == 2
    err = capsys.readouterr().err
    assert "invalid_document_id" in err and "Traceback" not in err
