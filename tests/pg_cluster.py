"""A test-owned PostgreSQL cluster that a test may stop and start (never the shared server).

:func:`pg_cluster` (a module-scoped fixture) runs ``initdb`` into a fresh directory under
``/tmp`` and starts the cluster on a free loopback port with its socket in that directory;
:class:`PgCluster` stops it (``pg_ctl stop -m fast``, which ends the open connections) and
starts it again on the same port, so a test can take the database away mid-answer. As root
the cluster's commands run as the ``postgres`` OS user (``initdb`` refuses root). The test
is skipped, with the reason, only when the PostgreSQL server binaries are not installed.

For replicas on separate hosts (network namespaces, :mod:`ragbudget_testing.netns`),
:func:`started_cluster` takes more listen addresses (the veth host ends) and subnets whose
clients are trusted (``pg_hba.conf``), and :meth:`PgCluster.url` names the host to dial.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<major>/bin`` holding ``initdb`` and ``pg_ctl``, else the
    ``PATH``'s; None when there is none."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit()
                   else 0)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb and shutil.which("pg_ctl") else None


@dataclass
class PgCluster:
    """One cluster: its directory (data in ``data/``, socket and log beside it) and port."""

    bin_dir: Path
    root: Path
    port: int
    as_user: str | None  # the OS user the commands run as (None: this user)
    listen: tuple[str, ...] = field(default=("127.0.0.1",))  # listen_addresses

    @property
    def data(self) -> Path:
        return self.root / "data"

    def admin_url(self, database: str = "postgres") -> str:
        """A SQLAlchemy URL of ``database`` (trust auth, user ``postgres``)."""
        return self.url(database)

    def url(self, database: str, host: str = "127.0.0.1") -> str:
        """A SQLAlchemy URL of ``database`` dialled at ``host`` (one of ``listen``; trust auth,
        user ``postgres``)."""
        return f"postgresql+psycopg://postgres@{host}:{self.port}/{database}"

    def _run(self, *args: str) -> None:
        cmd = [str(self.bin_dir / args[0]), *args[1:]]
        if self.as_user is not None:
            cmd = ["runuser", "-u", self.as_user, "--", *cmd]
        subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)

    def init(self, trust: Sequence[str] = ()) -> None:
        """``initdb`` (trust auth from 127.0.0.1 and ::1, UTF-8, superuser ``postgres``), and trust
        auth for TCP clients from each subnet in ``trust`` (CIDR, e.g. ``127.77.0.0/16``)."""
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-instructions")
        if trust:
            with (self.data / "pg_hba.conf").open("a", encoding="utf-8") as hba:
                hba.writelines(f"host all all {subnet} trust\n" for subnet in trust)

    def start(self) -> None:
        """Start the cluster on every ``listen`` address and wait until it accepts connections."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-w", "-t", "60",
                  "-o", f"-p {self.port} -k {self.root} -h {','.join(self.listen)}", "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the cluster (``fast``: open connections are ended, the server shuts down cleanly;
        ``immediate``: as a crash)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def create_database(self) -> str:
        """A fresh, empty database; returns its SQLAlchemy URL."""
        name = "t_" + uuid.uuid4().hex[:12]
        admin = create_engine(self.admin_url(), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as c:
                c.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            admin.dispose()
        return self.admin_url(name)

    def running(self) -> bool:
        """True when the cluster's postmaster runs."""
        return (self.data / "postmaster.pid").exists()


@contextlib.contextmanager
def started_cluster(listen: Sequence[str] = ("127.0.0.1",), trust: Sequence[str] = ()) -> Iterator[PgCluster]:
    """A started, test-owned cluster on a free port, listening on ``listen`` and trusting TCP
    clients from ``trust`` (CIDR subnets) besides loopback; stopped and removed afterwards.
    Skips the test when the server binaries (or, as root, the ``postgres`` OS user) are missing."""
    bin_dir = server_bin_dir()
    if bin_dir is None:
        pytest.skip("the PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    as_user = None
    root = Path(tempfile.mkdtemp(prefix="ragbudget-pg-"))
    if os.geteuid() == 0:
        try:
            who = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no postgres OS user to run initdb as")
        os.chown(root, who.pw_uid, who.pw_gid)
        as_user = "postgres"
    cluster = PgCluster(bin_dir, root, free_port(), as_user, tuple(listen))
    try:
        cluster.init(trust)
        cluster.start()
        yield cluster
    finally:
        if cluster.running():
            with contextlib.suppress(subprocess.SubprocessError):
                cluster.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def pg_cluster() -> Iterator[PgCluster]:
    """A started, test-owned cluster on a free port (removed afterwards; see the module doc)."""
    with started_cluster() as cluster:
        yield cluster
