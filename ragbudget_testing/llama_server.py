"""llama.cpp's OpenAI-compatible server (llama-cpp-python) as a child process, for tests and benchmarks.

``scripts/install_llama_server.sh`` builds llama-cpp-python from source once and
installs it into ``.venv-llama``; :class:`LlamaCppServer` starts
``python -m llama_cpp.server`` from there on a free loopback port with a GGUF
file, waits until ``/v1/models`` answers, and stops it on exit. ragbudget then
talks to it as to any remote engine (``RAGBUDGET_GENERATOR_BACKEND=remote``,
:mod:`generation.remote`; llama-cpp-python takes text prompts, so the ``text``
mode of :mod:`generation.remote_text` is used).

The engine's prompt cache: llama-cpp-python keeps the KV cache of the last
evaluated sequence and reuses its longest common token prefix with the next
prompt; with ``verbose`` on it reports each reuse on stderr as
``Llama.generate: N prefix-match hit, remaining M prompt tokens to eval``
(``llama_cpp/llama.py``, ``Llama.generate``). Its HTTP responses carry no cached
token count, so :meth:`LlamaCppServer.prefix_hits` reads that report from the log.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from foundation.errors import BackendError, InvalidConfig

DEFAULT_PYTHON = Path(__file__).resolve().parents[1] / ".venv-llama" / "bin" / "python"
DEFAULT_SERVER = Path(__file__).resolve().parents[1] / ".venv-llama" / "bin" / "llama-server"
PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")


def llama_python() -> Path:
    """The Python of the llama.cpp server venv (``RAGBUDGET_LLAMA_PYTHON``, else ``.venv-llama``).

    Raises:
        InvalidConfig: it does not exist (run ``bash scripts/install_llama_server.sh``).
    """
    path = Path(os.environ.get("RAGBUDGET_LLAMA_PYTHON") or DEFAULT_PYTHON)
    if not path.is_file():
        raise InvalidConfig(f"{path} does not exist; build the llama.cpp server with "
                            "`bash scripts/install_llama_server.sh`")
    return path


def llama_server_binary() -> Path:
    """llama.cpp's native ``llama-server`` (``RAGBUDGET_LLAMA_SERVER``, else ``.venv-llama/bin``).

    Raises:
        InvalidConfig: it does not exist (run ``bash scripts/install_llama_server.sh``).
    """
    path = Path(os.environ.get("RAGBUDGET_LLAMA_SERVER") or DEFAULT_SERVER)
    if not path.is_file():
        raise InvalidConfig(f"{path} does not exist; build llama.cpp's server with "
                            "`bash scripts/install_llama_server.sh`")
    return path


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to send SIGTERM when the parent dies (``PR_SET_PDEATHSIG``).

    So a server whose test run or benchmark was killed does not linger, holding a core.
    """
    import contextlib
    import ctypes
    import signal

    # not Linux/glibc (OSError): the server is still stopped by stop() / __exit__
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaCppServer:
    """``python -m llama_cpp.server`` serving one GGUF on 127.0.0.1 (a context manager).

    Args:
        gguf: the model file.
        log_path: where the server's stdout and stderr go (the prefix-match reports).
        alias: the model name clients send (``RAGBUDGET_REMOTE_MODEL``).
        n_ctx: context size in tokens (``RAGBUDGET_REMOTE_CONTEXT_WINDOW``).
        threads: ``n_threads`` and ``n_threads_batch`` (decode and prefill).
        python: the server venv's Python (default :func:`llama_python`).
        start_timeout_s: how long to wait for ``/v1/models``.

    Attributes:
        base_url: ``http://127.0.0.1:<port>/v1`` once started.
    """

    def __init__(self, gguf: Path, log_path: Path, *, alias: str = "model", n_ctx: int = 8192,
                 threads: int = 2, python: Path | None = None, start_timeout_s: float = 120.0) -> None:
        self.gguf, self.log_path, self.alias, self.n_ctx = Path(gguf), Path(log_path), alias, n_ctx
        self.threads, self.python, self.start_timeout_s = threads, python, start_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """The server's command line."""
        return [str(self.python or llama_python()), "-m", "llama_cpp.server",
                "--model", str(self.gguf), "--model_alias", self.alias, "--host", "127.0.0.1",
                "--port", str(self.port), "--n_ctx", str(self.n_ctx), "--n_threads", str(self.threads),
                "--n_threads_batch", str(self.threads), "--seed", "0", "--verbose", "true"]

    def start(self) -> LlamaCppServer:
        """Start the server and wait until it answers.

        Raises:
            InvalidConfig: the server venv is missing.
            BackendError: the server exited or did not answer in time (the log's tail is included).
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     preexec_fn=_die_with_parent)
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BackendError(f"llama.cpp server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/models", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise BackendError(f"llama.cpp server did not answer within {self.start_timeout_s:.0f} s: "
                           f"{self.log_tail()}")

    def stop(self) -> None:
        """Terminate the server (kill after 10 s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def log_text(self) -> str:
        """Everything the server wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def log_tail(self, chars: int = 2000) -> str:
        """The last ``chars`` characters the server wrote (for error messages)."""
        return self.log_text()[-chars:]

    def prefix_hits(self) -> list[tuple[int, int]]:
        """The engine's prompt-cache reports so far: ``[(reused tokens, evaluated tokens), ...]``."""
        return [(int(a), int(b)) for a, b in PREFIX_HIT.findall(self.log_text())]

    def __enter__(self) -> LlamaCppServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class NativeLlamaServer(LlamaCppServer):
    """llama.cpp's native ``llama-server`` serving one GGUF on 127.0.0.1 (a context manager).

    Unlike llama-cpp-python's server it runs ``parallel`` requests at once, one per
    slot, each slot with its own prompt cache, and reports its load: ``GET /props``
    (``total_slots``), ``GET /slots`` (each slot's state) and ``GET /metrics``
    (Prometheus). Its streamed completions end with ``timings.cache_n``, the prompt
    tokens taken from the slot's cache (tools/server/README.md in llama.cpp).

    Args:
        gguf, log_path, alias, n_ctx, threads, start_timeout_s: as :class:`LlamaCppServer`;
            ``n_ctx`` is the total over all slots (each slot gets ``n_ctx / parallel``).
        parallel: slots (requests decoded together).
        binary: the server (default :func:`llama_server_binary`).
        cpus: CPU ids to pin the server to with ``taskset`` (None: not pinned).
        host: address to listen on.
    """

    def __init__(self, gguf: Path, log_path: Path, *, alias: str = "model", n_ctx: int = 8192,
                 threads: int = 2, parallel: int = 1, binary: Path | None = None,
                 cpus: list[int] | None = None, host: str = "127.0.0.1",
                 start_timeout_s: float = 120.0) -> None:
        super().__init__(gguf, log_path, alias=alias, n_ctx=n_ctx, threads=threads,
                         start_timeout_s=start_timeout_s)
        self.parallel, self.binary, self.cpus, self.host = parallel, binary, cpus, host
        self.root_url = f"http://{host}:{self.port}"
        self.base_url = f"{self.root_url}/v1"

    def command(self) -> list[str]:
        """The server's command line (``taskset -c`` first when pinned)."""
        pin = ["taskset", "-c", ",".join(str(c) for c in self.cpus)] if self.cpus else []
        return pin + [str(self.binary or llama_server_binary()), "--model", str(self.gguf),
                      "--alias", self.alias, "--host", self.host, "--port", str(self.port),
                      "--ctx-size", str(self.n_ctx), "--parallel", str(self.parallel),
                      "--threads", str(self.threads), "--threads-batch", str(self.threads),
                      "--seed", "0", "--metrics", "--slots", "--no-webui"]

    def slots(self) -> list[dict[str, Any]]:
        """``GET /slots``: one object per slot (``id``, ``is_processing``, ...)."""
        return list(httpx.get(f"{self.root_url}/slots", timeout=5.0).json())

    def metrics(self) -> str:
        """``GET /metrics``: the server's Prometheus text."""
        return httpx.get(f"{self.root_url}/metrics", timeout=5.0).text


def flood(base_url: str, stop: threading.Event, *, model: str, max_tokens: int = 200,
          clients: int = 2, timeout_s: float = 300.0) -> list[threading.Thread]:
    """Another client that bypasses ragbudget: ``clients`` daemon threads, each sending long
    completions (``max_tokens`` tokens, ``ignore_eos``) straight to ``base_url``
    (``.../v1``) back to back until ``stop`` is set. With two clients on a one-slot server one
    request runs and the other waits behind it, so the slot never idles between them.

    Returns the started threads (join them after setting ``stop``). A request that fails
    (server down) is retried after 0.2 s.
    """

    def run() -> None:
        while not stop.is_set():
            try:
                httpx.post(f"{base_url}/completions", timeout=timeout_s,
                           json={"model": model, "prompt": "Write a long maintenance report.",
                                 "max_tokens": max_tokens, "ignore_eos": True})
            except httpx.HTTPError:
                time.sleep(0.2)

    threads = [threading.Thread(target=run, daemon=True, name="flood") for _ in range(clients)]
    for t in threads:
        t.start()
    return threads
