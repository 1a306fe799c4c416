"""What ``ingest`` collects from the paths it is given: symbolic links out of a directory are
refused unless asked for, a link loop is never followed, each real file is read once however
many links reach it, non-regular files are named as such, an empty ``--id`` is refused."""

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


def _statuses(rejected):
    return {r.document_id: (r.status, r.code) for r in rejected}


def test_symlinks_out_of_the_directory_are_refused_by_default(tree):
    items, rejected = collect_files([tree], 10_000)
    assert sorted(i.document_id for i in items) == ["a.txt"]
    assert _statuses(rejected) == {"link_out.txt": ("rejected", "symlink_outside"),
                                   "dir_out": ("rejected", "symlink_outside"),
                                   "pipe.txt": ("rejected", "not_regular_file"),
                                   "link_in.txt": ("skipped", "duplicate_file")}


def test_follow_symlinks_follows_them(tree):
    items, rejected = collect_files([tree], 10_000, follow_symlinks=True)
    assert sorted(i.document_id for i in items) == ["a.txt", "dir_out/more.txt", "link_out.txt"]
    assert _codes(rejected) == {"pipe.txt": "not_regular_file", "link_in.txt": "duplicate_file"}


@pytest.fixture
def looped(tmp_path: Path) -> Path:
    """Two files; ``sub/loop`` points back at the root, ``again`` at ``sub``, ``b_link.txt`` at
    ``sub/b.txt``, ``hard.txt`` is a hard link to ``a.txt``."""
    root = tmp_path / "looped"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("the first file")
    (root / "sub" / "b.txt").write_text("the second file")
    (root / "sub" / "loop").symlink_to(root, target_is_directory=True)
    (root / "again").symlink_to(root / "sub", target_is_directory=True)
    (root / "b_link.txt").symlink_to(root / "sub" / "b.txt")
    os.link(root / "a.txt", root / "hard.txt")
    return root


@pytest.mark.parametrize("follow", [False, True])
def test_a_symlink_loop_is_skipped_and_each_real_file_is_read_once(looped, follow):
    items, passed = collect_files([looped], 10_000, follow_symlinks=follow)
    assert sorted(i.document_id for i in items) == ["a.txt", "sub/b.txt"]
    assert _statuses(passed) == {"sub/loop": ("skipped", "symlink_loop"),
                                 "again": ("skipped", "duplicate_directory"),
                                 "b_link.txt": ("skipped", "duplicate_file"),
                                 "hard.txt": ("skipped", "duplicate_file")}
    by_id = {r.document_id: r.reason for r in passed}
    assert "sub/b.txt" in by_id["b_link.txt"] and "a.txt" in by_id["hard.txt"]
    assert "sub" in by_id["again"]


def test_a_loop_through_a_followed_outside_directory_is_skipped(tmp_path):
    outside = tmp_path / "outside"
    (outside / "deeper").mkdir(parents=True)
    (outside / "deeper" / "c.txt").write_text("outside text")
    (outside / "deeper" / "up").symlink_to(outside, target_is_directory=True)
    root = tmp_path / "docs"
    root.mkdir()
    (root / "ext").symlink_to(outside, target_is_directory=True)
    (root / "ext2").symlink_to(outside / "deeper", target_is_directory=True)
    items, passed = collect_files([root], 10_000, follow_symlinks=True)
    assert [i.document_id for i in items] == ["ext/deeper/c.txt"]
    assert _statuses(passed) == {"ext/deeper/up": ("skipped", "symlink_loop"),
                                 "ext2": ("skipped", "duplicate_directory")}


def test_a_dangling_or_self_referencing_link_is_refused_as_broken(tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.txt").write_text("text")
    (root / "gone.txt").symlink_to(root / "missing.txt")
    (root / "self.txt").symlink_to(root / "self.txt")
    items, passed = collect_files([root], 10_000, follow_symlinks=True)
    assert [i.document_id for i in items] == ["a.txt"]
    assert _codes(passed) == {"gone.txt": "broken_symlink", "self.txt": "broken_symlink"}


def test_a_directory_given_twice_is_read_once(looped):
    items, passed = collect_files([looped, looped / "sub"], 10_000)
    assert sorted(i.document_id for i in items) == ["a.txt", "sub/b.txt"]
    assert (".", "duplicate_directory") in {(r.document_id, r.code) for r in passed}


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
