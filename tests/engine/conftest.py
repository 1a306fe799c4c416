"""llama.cpp's server (llama-cpp-python, built by scripts/install_llama_server.sh) behind the remote backend.

Every test here is marked ``engine``. Without the server venv they are skipped
with the command that builds it, unless ``RAGBUDGET_REQUIRE_ENGINE=1`` (set by
``scripts/test.sh`` once it has built the server), which makes a missing server an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

ALIAS = "smollm2-135m-instruct-q4_1"
N_CTX = 8192
DOCS = {
    "pump.txt": "Pump station maintenance. The circulation pump is inspected on the first Monday of "
                "every month by the duty engineer, who records the pressure and the bearing noise.",
    "valves.txt": "Valve replacement policy. Gate valves are replaced every five years; check valves "
                  "are tested every spring and replaced when they leak.",
    "filters.txt": "Filter cleaning. Sand filters are backwashed weekly. The carbon filter media is "
                   "replaced every eighteen months or when the outlet odour test fails.",
    "alarms.txt": "Alarm handling. A high-pressure alarm is acknowledged at the panel within five "
                  "minutes, then the engineer on call is phoned and the event is logged.",
}


@pytest.fixture(scope="session")
def llama_server_python() -> Path:
    from foundation.errors import InvalidConfig
    from ragbudget_testing.llama_server import llama_python

    try:
        return llama_python()
    except InvalidConfig as exc:
        if os.environ.get("RAGBUDGET_REQUIRE_ENGINE") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def llama_server_native_binary() -> Path:
    """llama.cpp's native ``llama-server`` binary; skipped when it is not built (failed instead
    under ``RAGBUDGET_REQUIRE_ENGINE=1``, as the test command sets once it built it)."""
    from foundation.errors import InvalidConfig
    from ragbudget_testing.llama_server import llama_server_binary

    try:
        return llama_server_binary()
    except InvalidConfig as exc:
        if os.environ.get("RAGBUDGET_REQUIRE_ENGINE") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def llama_server(llama_server_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The packaged SmolLM2 GGUF served by llama.cpp on loopback, 2 threads, for the whole session."""
    from generation.assets import packaged_gguf_path
    from ragbudget_testing.llama_server import LlamaCppServer

    log = tmp_path_factory.mktemp("llama") / "server.log"
    with LlamaCppServer(packaged_gguf_path(), log, alias=ALIAS, n_ctx=N_CTX, threads=2,
                        python=llama_server_python) as server:
        yield server


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The HF copy of the packaged SmolLM2 GGUF: the tokenizer of the model the server runs."""
    from generation.assets import ensure_packaged_generator

    return ensure_packaged_generator(REPO / "ragbudget-data")


@pytest.fixture(scope="session")
def engine_env(llama_server: Any, smollm_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment of a ragbudget process using the server, with a small corpus ingested."""
    root = tmp_path_factory.mktemp("engine")
    docs = root / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGBUDGET_")}
    env.update({"RAGBUDGET_DATA_DIR": str(root / "data"), "RAGBUDGET_GENERATOR_BACKEND": "remote",
                "RAGBUDGET_REMOTE_BASE_URL": llama_server.base_url, "RAGBUDGET_REMOTE_MODEL": ALIAS,
                "RAGBUDGET_REMOTE_TOKENIZER": str(smollm_dir),
                "RAGBUDGET_REMOTE_CONTEXT_WINDOW": str(N_CTX), "RAGBUDGET_TORCH_THREADS": "1"})
    run_cli(env, "ingest", str(docs))
    return env


def run_cli(env: dict[str, str], *argv: str, ok: bool = True) -> dict[str, Any]:
    """``ragbudget ARGV --json`` in a subprocess (as a user runs it); the parsed JSON output."""
    proc = subprocess.run([sys.executable, "-m", "app.cli.main", *argv, "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1200)
    if ok and proc.returncode != 0:
        raise AssertionError(f"ragbudget {' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    out = proc.stdout.strip()
    return json.loads(out) if out.startswith(("{", "[")) else {"returncode": proc.returncode,
                                                                "stderr": proc.stderr}
