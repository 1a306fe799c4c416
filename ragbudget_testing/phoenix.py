"""Arize Phoenix's local trace server as a child process, for the trace tests and benchmark.

``scripts/install_phoenix.sh`` installs a pinned ``arize-phoenix`` into ``.venv-phoenix``;
:class:`PhoenixServer` starts ``python -m phoenix.server.main serve`` from there with
``PHOENIX_PORT`` and ``PHOENIX_GRPC_PORT`` on free loopback ports, ``PHOENIX_HOST`` =
127.0.0.1, ``PHOENIX_WORKING_DIR`` (its SQLite database) in a given folder and its usage
telemetry off (``PHOENIX_TELEMETRY_ENABLED=false``; variables from ``phoenix/config.py``),
waits until ``/healthz`` answers, and stops it on exit. It receives OTLP/HTTP at
``/v1/traces`` and lists a project's spans at ``GET /v1/projects/{project}/spans`` (its REST
API, ``phoenix/server/api/routers/v1/spans.py``).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from foundation.errors import BackendError, InvalidConfig
from ragbudget_testing.llama_server import _die_with_parent, free_port

DEFAULT_PYTHON = Path(__file__).resolve().parents[1] / ".venv-phoenix" / "bin" / "python"
INSTALL = "bash scripts/install_phoenix.sh"


def phoenix_python() -> Path:
    """The Python of the Phoenix venv (``RAGBUDGET_PHOENIX_PYTHON``, else ``.venv-phoenix``).

    Raises:
        InvalidConfig: it does not exist (run ``bash scripts/install_phoenix.sh``).
    """
    path = Path(os.environ.get("RAGBUDGET_PHOENIX_PYTHON") or DEFAULT_PYTHON)
    if not path.is_file():
        raise InvalidConfig(f"{path} does not exist; install Phoenix with `{INSTALL}`")
    return path


class PhoenixServer:
    """One Phoenix server on free loopback ports; a context manager (start on enter, stop on exit).

    ``working_dir``: its data (SQLite) and ``phoenix.log``; ``start_timeout_s``: how long
    to wait for ``/healthz``.
    """

    def __init__(self, working_dir: Path, *, start_timeout_s: float = 180.0) -> None:
        self.working_dir = working_dir
        self.port = free_port()
        self.grpc_port = free_port()
        self.start_timeout_s = start_timeout_s
        self.log_path = working_dir / "phoenix.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def otlp_endpoint(self) -> str:
        """Its OTLP/HTTP traces URL (ragbudget's ``otlp_endpoint``)."""
        return f"{self.base_url}/v1/traces"

    def start(self) -> PhoenixServer:
        """Start the server and wait until ``/healthz`` answers.

        Raises:
            InvalidConfig: Phoenix is not installed.
            BackendError: it exited or did not answer within ``start_timeout_s`` (log tail included).
        """
        python = phoenix_python()
        self.working_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PHOENIX_PORT": str(self.port), "PHOENIX_GRPC_PORT": str(self.grpc_port),
               "PHOENIX_HOST": "127.0.0.1", "PHOENIX_WORKING_DIR": str(self.working_dir),
               "PHOENIX_TELEMETRY_ENABLED": "false"}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen([str(python), "-m", "phoenix.server.main", "serve"], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BackendError(f"Phoenix exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise BackendError(f"Phoenix did not answer in {self.start_timeout_s:.0f} s: {self.log_tail()}")

    def spans(self, project: str, limit: int = 1000) -> list[dict[str, Any]]:
        """Every span of ``project`` (``GET /v1/projects/{project}/spans``, all pages); [] when
        the project does not exist yet (404: nothing received)."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": limit, **({"cursor": cursor} if cursor else {})}
            r = httpx.get(f"{self.base_url}/v1/projects/{project}/spans", params=params, timeout=30.0)
            if r.status_code == 404:
                return out
            r.raise_for_status()
            body = r.json()
            out.extend(body["data"])
            cursor = body.get("next_cursor")
            if not cursor:
                return out

    def wait_spans(self, project: str, count: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """:meth:`spans` once at least ``count`` are there (Phoenix stores what it receives in
        the background), or whatever is there after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans(project)
            if len(spans) >= count or time.monotonic() > deadline:
                return spans
            time.sleep(0.2)

    def log_tail(self, chars: int = 2000) -> str:
        """The last ``chars`` characters of its log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate the server (kill after 10 s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> PhoenixServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
