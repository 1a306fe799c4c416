"""Fetching the real corpus: the PostgreSQL 15 HTML documentation from its Debian package.

``fetch_postgres_docs`` finds ``postgresql-doc-15_<version>-0+deb12u1_all.deb``
(an explicit path, then the given search directories, then an earlier
download, then ``apt-get download``), and unpacks the HTML pages of
``usr/share/doc/postgresql-doc-15/html/`` flat into
``<data_dir>/corpora/postgres-docs-<version>/``, so each page's file name is
its document id. Unpacking goes to a temporary directory that is renamed into
place, and a hidden marker (``.ragbudget-corpus.json``, skipped by ingest)
records the source and page count, so a fetch is idempotent and an
interrupted one never leaves a half-filled corpus behind.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from foundation.errors import InvalidInput, NotFound
from foundation.hashing import sha256_file

SOURCE = "postgres-docs"
VERSIONS = ("15.18", "15.20")
HTML_DIR = "usr/share/doc/postgresql-doc-15/html"
MARKER = ".ragbudget-corpus.json"


@dataclass(frozen=True)
class FetchResult:
    """Where the pages are, how many, and from which package (``deb_sha256`` as ``sha256:``)."""

    path: str
    pages: int
    version: str
    deb: str
    deb_sha256: str
    reused: bool

    def to_dict(self) -> dict[str, object]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def deb_name(version: str) -> str:
    """The Debian 12 package file name for a PostgreSQL 15 doc release."""
    return f"postgresql-doc-15_{version}-0+deb12u1_all.deb"


def corpus_dir(data_dir: Path, version: str) -> Path:
    """``<data_dir>/corpora/postgres-docs-<version>``."""
    return data_dir / "corpora" / f"{SOURCE}-{version}"


def _check_version(version: str) -> str:
    parts = version.split(".")
    if len(parts) != 2 or parts[0] != "15" or not parts[1].isdigit():
        raise InvalidInput(f"unsupported PostgreSQL docs version {version!r}; expected 15.<minor>, "
                           f"e.g. {' or '.join(VERSIONS)}")
    return version


def find_deb(version: str, data_dir: Path, deb: Path | None = None,
             search_dirs: list[Path] | tuple[Path, ...] = ()) -> Path:
    """Locate (or download) the package for ``version``.

    Order: ``deb``; ``<dir>/<deb_name>`` for each of ``search_dirs``;
    ``<data_dir>/downloads/<deb_name>``; ``apt-get download
    postgresql-doc-15=<version>-0+deb12u1`` into ``<data_dir>/downloads``.

    Raises:
        NotFound: (``corpus_unavailable``) ``deb`` does not exist, or nothing was
            found and apt-get is missing or failed.
    """
    if deb is not None:
        if not deb.is_file():
            raise NotFound(f"no such .deb file: {deb}", code="corpus_unavailable")
        return deb
    name = deb_name(_check_version(version))
    for d in search_dirs:
        if (d / name).is_file():
            return d / name
    downloads = data_dir / "downloads"
    if (downloads / name).is_file():
        return downloads / name
    if shutil.which("apt-get") is None:
        raise NotFound(f"{name} not found and apt-get is not available; pass --deb PATH",
                       code="corpus_unavailable")
    downloads.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["apt-get", "download", f"postgresql-doc-15={version}-0+deb12u1"],
                          cwd=downloads, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not (downloads / name).is_file():
        raise NotFound(f"apt-get download of postgresql-doc-15={version}-0+deb12u1 failed: "
                       f"{(proc.stderr or proc.stdout).strip()[-500:]}", code="corpus_unavailable")
    return downloads / name


def _extract_with_dpkg(deb: Path, out: Path, scratch: Path) -> None:
    subprocess.run(["dpkg-deb", "-x", str(deb), str(scratch)], check=True, capture_output=True)
    src = scratch / HTML_DIR
    if not src.is_dir():
        raise InvalidInput(f"{deb.name} holds no {HTML_DIR}/ directory")
    for page in src.glob("*.html"):
        if page.is_file():
            shutil.move(str(page), out / page.name)


def _extract_with_python(deb: Path, out: Path) -> None:
    """Read the ``ar`` archive and its ``data.tar.*`` member (gz, xz, bz2) without dpkg."""
    data = deb.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise InvalidInput(f"{deb.name} is not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        body = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
        if not name.startswith("data.tar"):
            continue
        try:
            tar_cm = tarfile.open(fileobj=io.BytesIO(body), mode="r:*")  # noqa: SIM115
        except tarfile.ReadError as exc:
            raise InvalidInput(f"cannot read {name} of {deb.name} without dpkg-deb: {exc}") from exc
        with tar_cm as tar:
            for member in tar:
                path = member.name.lstrip("./")
                if (member.isfile() and path.startswith(HTML_DIR + "/") and path.endswith(".html")
                        and "/" not in path[len(HTML_DIR) + 1:]):
                    f = tar.extractfile(member)
                    if f is not None:
                        (out / Path(path).name).write_bytes(f.read())
        return
    raise InvalidInput(f"{deb.name} has no data.tar member")


def _complete(target: Path) -> dict[str, object] | None:
    marker = target / MARKER
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if len(list(target.glob("*.html"))) != info.get("pages"):
        return None
    return dict(info)


def fetch_postgres_docs(data_dir: Path, version: str, deb: Path | None = None,
                        search_dirs: list[Path] | tuple[Path, ...] = (),
                        use_dpkg: bool | None = None) -> FetchResult:
    """Unpack the PostgreSQL ``version`` HTML docs into :func:`corpus_dir` (idempotent, atomic).

    ``use_dpkg`` None: ``dpkg-deb -x`` when installed, else the pure-Python reader.

    Raises:
        InvalidInput: bad version string or an unreadable package.
        NotFound: the package cannot be found or downloaded (see :func:`find_deb`).
    """
    _check_version(version)
    target = corpus_dir(data_dir, version)
    info = _complete(target)
    if info is not None and deb is None:
        return FetchResult(str(target), int(str(info["pages"])), version, str(info["deb"]),
                           str(info["deb_sha256"]), reused=True)
    found = find_deb(version, data_dir, deb, search_dirs)
    digest = sha256_file(found)
    if info is not None and info.get("deb_sha256") == digest:
        return FetchResult(str(target), int(str(info["pages"])), version, found.name, digest, reused=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    scratch = Path(tempfile.mkdtemp(prefix=".unpack-", dir=target.parent))
    try:
        out = tmp / "pages"
        out.mkdir()
        if use_dpkg is None:
            use_dpkg = shutil.which("dpkg-deb") is not None
        if use_dpkg:
            _extract_with_dpkg(found, out, scratch)
        else:
            _extract_with_python(found, out)
        pages = len(list(out.glob("*.html")))
        if pages == 0:
            raise InvalidInput(f"{found.name} holds no HTML pages under {HTML_DIR}/")
        (out / MARKER).write_text(json.dumps({"source": SOURCE, "version": version, "deb": found.name,
                                              "deb_sha256": digest, "pages": pages}, sort_keys=True))
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
            target.rename(old / "pages")
            out.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            out.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return FetchResult(str(target), pages, version, found.name, digest, reused=False)
