"""Two or more ``ragbudget serve`` replicas, each on its own host (a network namespace), on one
test-owned PostgreSQL cluster.

:func:`replica_fleet` makes the namespaces (:mod:`ragbudget_testing.netns`), starts a cluster
that listens on the veth host ends and trusts their subnet (:func:`tests.pg_cluster.started_cluster`),
creates a database and brings it to the head revision with ``ragbudget db upgrade`` (Alembic,
as the app does), ingests a slice of the real corpus and creates an admin key with the CLI
from this host, then starts ``ragbudget serve`` in every namespace on ``127.77.N.2:8000``
with its own data directory (its own FAISS index, converted model copy and online
correction), the packaged SmolLM2 and the packaged embedder, and dialling PostgreSQL at
``127.77.N.1``. Everything is stopped and deleted on exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ragbudget_testing.netns import SUBNET, NetNamespace, network_namespaces
from tests.pg_cluster import PgCluster, started_cluster

RAGBUDGET = Path(sys.executable).parent / "ragbudget"  # the console script in this venv
PORT = 8000  # every replica's port: each host has its own
START_TIMEOUT_S = 300.0
#: What every answer in these tests asks: a budget every k fits under the roofline prior, two
#: chunks at most and two new tokens (the store is under test, not the model).
ASK: dict[str, Any] = {"ttft_budget_ms": 60_000.0, "max_new_tokens": 2, "k_max": 2}


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the test process dies (``PR_SET_PDEATHSIG``)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def cli(env: dict[str, str], *argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``ragbudget *argv`` on this host with ``env`` added to the environment (checked)."""
    out = subprocess.run([str(RAGBUDGET), *argv], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"ragbudget {' '.join(argv)} exited {out.returncode}:\n"
                             f"{out.stdout}\n{out.stderr}")
    return out


@dataclass
class Replica:
    """One ``ragbudget serve`` process inside ``ns``."""

    name: str
    ns: NetNamespace
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """``http://127.77.N.2:8000``: the replica as a load balancer on this host dials it."""
        return f"http://{self.ns.ns_ip}:{PORT}"

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the replica's log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self, env: dict[str, str]) -> None:
        """Start ``ragbudget serve`` in the namespace; return once ``/healthz`` answers 200 (the
        models, index and prefix cache are loaded before the server binds).

        Raises:
            AssertionError: it exited or did not answer in time (with its log's tail).
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.ns.command([str(RAGBUDGET), "serve", "--host", self.ns.ns_ip, "--port", str(PORT)]),
                env={**os.environ, **env, "RAGBUDGET_DATA_DIR": str(self.data_dir)},
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"replica {self.name} exited with {self.proc.returncode}:\n"
                                     f"{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/healthz", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"replica {self.name} did not answer within {START_TIMEOUT_S:.0f} s:\n"
                             f"{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM (the graceful shutdown ``ragbudget serve`` does), SIGKILL after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


@dataclass
class Fleet:
    """The running replicas, the cluster and the CLI environment that reaches its database."""

    replicas: list[Replica]
    cluster: PgCluster
    database_url: str  # dialled from this host (127.0.0.1)
    env: dict[str, str]  # RAGBUDGET_* for the CLI on this host
    admin_key: str
    revision: int
    documents: list[str] = field(default_factory=list)

    def headers(self, key: str | None = None) -> dict[str, str]:
        """Authorization headers for ``key`` (default: the admin key)."""
        return {"Authorization": f"Bearer {key or self.admin_key}"}


def _generator_path() -> str:
    """The fp32 copy of the packaged SmolLM2, converted once into the checkout's ``ragbudget-data``."""
    from generation.assets import ensure_packaged_generator

    return str(ensure_packaged_generator(Path(__file__).resolve().parents[2] / "ragbudget-data"))


@contextlib.contextmanager
def replica_fleet(root: Path, pages: Sequence[Path], count: int = 2) -> Iterator[Fleet]:
    """``count`` replicas on one cluster, the corpus ``pages`` ingested (see the module doc).

    Raises:
        AssertionError: a CLI step failed or a replica did not start (with its output).
    """
    with network_namespaces(count) as spaces, \
            started_cluster(listen=("127.0.0.1", *(ns.host_ip for ns in spaces)), trust=(SUBNET,)) as cluster:
        database = cluster.create_database()
        name = database.rsplit("/", 1)[1]
        common = {"RAGBUDGET_AUTH_ENABLED": "true", "RAGBUDGET_GENERATOR_PATH": _generator_path(),
                  "RAGBUDGET_GENERATOR_DEVICE": "cpu", "RAGBUDGET_TORCH_THREADS": "1",
                  "RAGBUDGET_RETRIEVAL_CANDIDATES": "2", "RAGBUDGET_ON_BUDGET_MISS": "answer",
                  "RAGBUDGET_SHUTDOWN_GRACE_S": "5"}
        env = {**common, "RAGBUDGET_DATABASE_URL": database, "RAGBUDGET_DATA_DIR": str(root / "cli")}
        cli(env, "db", "upgrade")
        revision = int(json.loads(cli(env, "ingest", "--json", *map(str, pages)).stdout)["revision"])
        key = json.loads(cli(env, "keys", "create", "--role", "admin", "--name", "fleet admin",
                             "--json").stdout)["key"]
        replicas = [Replica(chr(ord("a") + i), ns, root / f"replica-{i}", root / f"replica-{i}.log")
                    for i, ns in enumerate(spaces)]
        try:
            for r in replicas:
                r.start({**common, "RAGBUDGET_DATABASE_URL": cluster.url(name, host=r.ns.host_ip)})
            yield Fleet(replicas, cluster, database, env, key, revision, [p.name for p in pages])
        finally:
            for r in replicas:
                r.stop()
