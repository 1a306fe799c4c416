"""Which files under an ingest folder become documents: each real file once, loops never followed.

A folder is walked in two passes per directory tree. First the tree itself,
without following any symbolic link; every directory and regular file met is
remembered by its identity ``(st_dev, st_ino)``, the pair ``os.stat`` gives and
``os.walk`` uses to tell files apart. Then the symbolic links met, in path order:

* a link to a directory that is one of the link's own ancestors (through any
  chain of links) is a loop: skipped, code ``symlink_loop``. Following it, as
  ``os.walk(followlinks=True)`` does, walks the same files again at every
  level until the path grows past the system's limit (~40 levels);
* a link to a directory already walked (inside the folder, or through another
  link) is skipped, code ``duplicate_directory``; its files are ingested once,
  under the path reached first (the real path before any link);
* a link to a file already taken, or a second hard link to it, is skipped,
  code ``duplicate_file``, naming the document id that has it;
* a link whose target is outside the folder is refused (``symlink_outside``)
  unless ``follow_symlinks``; a link to a directory inside the folder that was
  not walked (a hidden one) is skipped (``symlink_not_followed``) unless
  ``follow_symlinks``; a dangling link or one the system cannot resolve (a
  link to itself) is refused (``broken_symlink``); anything that is not a
  regular file or a directory (a FIFO, a socket, a device) is refused
  (``not_regular_file``).

Hidden entries (names starting with ``.``) are not walked. One
:class:`FolderWalk` can walk several folders: a file reached from two of them
is taken once.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

Identity = tuple[int, int]

OUTSIDE_REASON = "a symbolic link out of the ingest directory (--follow-symlinks to follow it)"


@dataclass(frozen=True)
class Passed:
    """A path not taken: ``status`` ``rejected`` (bad input) or ``skipped`` (already covered),
    with a machine-readable ``code`` and a ``reason``; ``rel`` is its ``/``-separated path
    relative to the folder."""

    rel: str
    path: Path
    status: str
    code: str
    reason: str


@dataclass
class FolderWalk:
    """Walks ingest folders, remembering every directory and file identity it took.

    ``files``/``dirs`` map an identity to the display name it was first taken under.
    """

    follow_symlinks: bool = False
    files: dict[Identity, str] = field(default_factory=dict)
    dirs: dict[Identity, str] = field(default_factory=dict)

    def walk(self, root: Path) -> tuple[list[tuple[str, Path]], list[Passed]]:
        """``(files, passed)`` under directory ``root``: ``(rel, path)`` per file to read, sorted
        by ``rel``, and every path not taken (see the module docstring), sorted likewise.

        Raises:
            OSError: ``root`` itself cannot be read.
        """
        base = root.resolve()
        found: list[tuple[str, Path]] = []
        passed: list[Passed] = []
        ident = _identity(os.stat(root))
        if ident in self.dirs:
            passed.append(Passed(".", root, "skipped", "duplicate_directory",
                                 f"the same directory as {self.dirs[ident]} (walked already)"))
            return found, passed
        self.dirs[ident] = str(root)
        self._tree(root, "", (ident,), base, found, passed)
        return sorted(found), sorted(passed, key=lambda p: p.rel)

    def _tree(self, top: Path, prefix: str, chain: tuple[Identity, ...], base: Path,
              found: list[tuple[str, Path]], passed: list[Passed]) -> None:
        """Walk ``top`` (shown as ``prefix``) without following links, then its links in order."""
        chains: dict[str, tuple[Identity, ...]] = {str(top): chain}
        links: list[tuple[Path, str, tuple[Identity, ...]]] = []
        for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
            here = Path(dirpath)
            here_chain = chains[dirpath]
            keep: list[str] = []
            for d in sorted(dirnames):
                p, rel = here / d, prefix + (here / d).relative_to(top).as_posix()
                if d.startswith("."):
                    continue
                if p.is_symlink():
                    links.append((p, rel, here_chain))
                    continue
                ident = _identity(os.stat(p))
                if ident in self.dirs:  # a bind mount or the like: the same directory again
                    passed.append(Passed(rel, p, "skipped", "duplicate_directory",
                                         f"the same directory as {self.dirs[ident]}"))
                    continue
                self.dirs[ident] = rel
                chains[str(p)] = here_chain + (ident,)
                keep.append(d)
            dirnames[:] = keep
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                p, rel = here / name, prefix + (here / name).relative_to(top).as_posix()
                if p.is_symlink():
                    links.append((p, rel, here_chain))
                    continue
                self._file(p, rel, os.lstat(p), found, passed)
        for p, rel, parent_chain in sorted(links, key=lambda t: t[1]):
            self._link(p, rel, parent_chain, base, found, passed)

    def _file(self, p: Path, rel: str, st: os.stat_result, found: list[tuple[str, Path]],
              passed: list[Passed]) -> None:
        """Take the regular file ``p`` unless its identity was taken already."""
        if not stat.S_ISREG(st.st_mode):
            passed.append(Passed(rel, p, "rejected", "not_regular_file", "not a regular file"))
            return
        ident = _identity(st)
        first = self.files.get(ident)
        if first is not None:
            passed.append(Passed(rel, p, "skipped", "duplicate_file",
                                 f"the same file as {first} (a link to it, or a hard link)"))
            return
        self.files[ident] = rel
        found.append((rel, p))

    def _link(self, p: Path, rel: str, parent_chain: tuple[Identity, ...], base: Path,
              found: list[tuple[str, Path]], passed: list[Passed]) -> None:
        """Follow, skip or refuse the symbolic link ``p`` (see the module docstring)."""
        try:
            st = os.stat(p)
        except OSError as exc:
            passed.append(Passed(rel, p, "rejected", "broken_symlink",
                                 f"a symbolic link that does not resolve ({exc.strerror})"))
            return
        inside = p.resolve().is_relative_to(base)
        if not inside and not self.follow_symlinks:
            passed.append(Passed(rel, p, "rejected", "symlink_outside", OUTSIDE_REASON))
            return
        if not stat.S_ISDIR(st.st_mode):
            self._file(p, rel, st, found, passed)
            return
        ident = _identity(st)
        if ident in parent_chain:
            passed.append(Passed(rel, p, "skipped", "symlink_loop",
                                 "a symbolic link to a directory that contains it: following it "
                                 "would walk the same files again at every level"))
        elif ident in self.dirs:
            passed.append(Passed(rel, p, "skipped", "duplicate_directory",
                                 f"the same directory as {self.dirs[ident] or '.'} (walked already)"))
        elif not self.follow_symlinks:
            passed.append(Passed(rel, p, "skipped", "symlink_not_followed",
                                 "a symbolic link to a directory (--follow-symlinks to follow it)"))
        else:
            self.dirs[ident] = rel
            self._tree(p, rel + "/", parent_chain + (ident,), base, found, passed)


def _identity(st: os.stat_result) -> Identity:
    """``(st_dev, st_ino)``: what tells two paths to one file or directory apart."""
    return (st.st_dev, st.st_ino)
