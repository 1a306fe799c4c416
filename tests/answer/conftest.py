"""Session fixtures for answer tests: real models over a handful of real PostgreSQL doc pages.

One session-scoped :class:`app.services.Services` (SQLite in a tmp data dir, auth
disabled, the packaged SmolLM2 already converted under ``ragbudget-data``) holds
the models, so every test shares one load of the generator and the embedder. One
app (and its pipeline, queue and metrics) is built on it and served by uvicorn in
a background thread on a free loopback port, so streaming and disconnects are real.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CORPORA

REPO = Path(__file__).resolve().parents[2]
DEB = CORPORA / "postgresql-doc-15_15.18-0+deb12u1_all.deb"
HTML = "usr/share/doc/postgresql-doc-15/html"
PAGES = ["backup-dump.html", "sql-vacuum.html", "sql-analyze.html", "indexes-types.html",
         "runtime-config-autovacuum.html"]
QUESTION = "How do I dump a database with pg_dump?"
#: A budget that every k fits under the roofline prior; K (retrieval_candidates) keeps prompts short.
BUDGET_MS = 60_000.0
CANDIDATES = 3


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """``(event name, data)`` per server-sent event; ``("message", "[DONE]")`` for the terminator."""
    name, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = "message", []
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)


@dataclass
class Corpus:
    """The ingested pages: where the data lives and the live revision."""

    data_dir: Path
    revision: int
    documents: list[str]


@pytest.fixture(scope="session")
def pg_html(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 15.18 HTML directory, unpacked with ``dpkg-deb -x`` into a session tmp dir."""
    if not DEB.exists() or shutil.which("dpkg-deb") is None:
        pytest.skip("real corpus or dpkg-deb not available")
    dest = tmp_path_factory.mktemp("pgdoc")
    subprocess.run(["dpkg-deb", "-x", str(DEB), str(dest)], check=True)
    return dest / HTML


@pytest.fixture(scope="session")
def generator_path() -> str:
    """The fp32 copy of the packaged SmolLM2 (converted once, shared with other tests)."""
    from generation.assets import ensure_packaged_generator

    return str(ensure_packaged_generator(REPO / "ragbudget-data"))


@pytest.fixture(scope="session")
def answer_services(tmp_path_factory: pytest.TempPathFactory, pg_html: Path,
                    generator_path: str) -> Iterator[Any]:
    """Services on SQLite with auth off, and the five pages ingested with real embeddings."""
    from app.services import Services
    from app.settings import get_settings
    from retrieval.chunking import ChunkerConfig
    from retrieval.extract import html_to_text
    from retrieval.store import IngestItem, ingest_batch

    data_dir = tmp_path_factory.mktemp("answer") / "data"
    settings = get_settings(data_dir=data_dir, database_url=None, auth_enabled=False,
                            generator_path=generator_path, generator_device="cpu", torch_threads=1,
                            default_ttft_budget_ms=BUDGET_MS, retrieval_candidates=CANDIDATES)
    services = Services(settings)
    items = [IngestItem(document_id=p, text=html_to_text((pg_html / p).read_bytes())) for p in PAGES]
    report = ingest_batch(services.engine, items, tokenizer=services.tokenizer,
                          chunker_config=ChunkerConfig(settings.chunk_tokens, settings.chunk_overlap_tokens),
                          embedder=services.embedder)
    assert report.counts["added"] == len(PAGES)
    yield services
    services.close()


@pytest.fixture(scope="session")
def corpus(answer_services: Any) -> Corpus:
    from foundation.db import read_session
    from retrieval.store import latest_revision

    with read_session(answer_services.engine) as s:
        rev = latest_revision(s)
    return Corpus(answer_services.settings.data_dir, int(rev or 0), list(PAGES))


@pytest.fixture(scope="session")
def answer_app(answer_services: Any) -> Any:
    """One FastAPI app (one pipeline, queue and metrics registry), warmed outside any request."""
    from app.api.app import create_app

    app = create_app(services=answer_services)
    app.state.pipeline.warm()
    return app


@dataclass
class LiveServer:
    """A uvicorn server in a background thread of this process."""

    base_url: str
    app: Any

    @property
    def pipeline(self) -> Any:
        return self.app.state.pipeline


@pytest.fixture(scope="session")
def live_server(answer_app: Any) -> Iterator[LiveServer]:
    """``answer_app`` served on ``127.0.0.1:<free port>``; stopped at the end of the session."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(answer_app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("uvicorn did not start")
        time.sleep(0.05)
    yield LiveServer(f"http://127.0.0.1:{port}", answer_app)
    server.should_exit = True
    thread.join(15)


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> Iterator[Any]:
    """An ``openai`` 2.x client on the live server's ``/v1`` (auth is off; no retries)."""
    from openai import OpenAI

    c = OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused-auth-disabled", max_retries=0,
               timeout=120)
    yield c
    c.close()


def receipt_body(services: Any, receipt_id: str) -> dict[str, Any]:
    """The stored receipt body of ``receipt_id``."""
    from receipts.chain import get_receipt

    return get_receipt(services.engine, receipt_id)


def wait_idle(pipeline: Any, timeout_s: float = 30.0) -> None:
    """Wait until no generation holds the model and nobody waits (the worker wrote its receipt)."""
    deadline = time.monotonic() + timeout_s
    while pipeline.queue.busy or pipeline.queue.depth:
        if time.monotonic() > deadline:
            raise AssertionError(f"queue still busy={pipeline.queue.busy} depth={pipeline.queue.depth}")
        time.sleep(0.02)
