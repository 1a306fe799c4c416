"""The remote backend against a real OpenAI-compatible streaming server on loopback.

The server is ragbudget itself (``ragbudget serve`` in a subprocess, on the same
data directory), so its ``/v1/chat/completions`` streams real tokens from the
local SmolLM2. Client-side TTFT and TPOT follow vLLM's benchmark definitions:
TTFT is the arrival of the first chunk with non-empty text (the role-only first
chunk and the usage-only last chunk do not count), TPOT is
``(t_last - t_first) / (output_tokens - 1)`` with output tokens recounted by the
model's tokenizer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.answer.conftest import BUDGET_MS, CANDIDATES, QUESTION, Corpus, free_port

pytestmark = pytest.mark.slow

MAX_NEW = 12


def _serve_command() -> list[str]:
    script = Path(sys.executable).with_name("ragbudget")
    return [str(script)] if script.exists() else [sys.executable, "-m", "app.cli.main"]


@pytest.fixture(scope="module")
def server_url(corpus: Corpus, generator_path: str) -> Iterator[str]:
    """``ragbudget serve`` on a free port over the test corpus; its ``/v1`` base URL."""
    port = free_port()
    env = {**os.environ, "RAGBUDGET_DATA_DIR": str(corpus.data_dir), "RAGBUDGET_AUTH_ENABLED": "false",
           "RAGBUDGET_GENERATOR_PATH": generator_path, "RAGBUDGET_GENERATOR_DEVICE": "cpu",
           "RAGBUDGET_TORCH_THREADS": "1", "RAGBUDGET_RETRIEVAL_CANDIDATES": str(CANDIDATES),
           "RAGBUDGET_DEFAULT_TTFT_BUDGET_MS": str(BUDGET_MS)}
    env.pop("RAGBUDGET_DATABASE_URL", None)
    log = corpus.data_dir.parent / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*_serve_command(), "serve", "--host", "127.0.0.1", "--port", str(port)],
                                env=env, cwd=corpus.data_dir.parent, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ragbudget serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"ragbudget serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def remote(server_url: str, answer_services: Any) -> Iterator[Any]:
    from generation.remote import RemoteGenerator

    gen = RemoteGenerator(server_url, "ragbudget", tokenizer=answer_services.tokenizer)
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def streamed(remote: Any) -> dict[str, Any]:
    from generation.base import GenParams

    answer = remote.stream(remote.tokenizer.encode(QUESTION), params=GenParams(max_new_tokens=MAX_NEW),
                           messages=[{"role": "user", "content": QUESTION}])
    events = list(answer)
    return {"events": events, "stats": answer.stats, "text": "".join(e.text for e in events)}


def test_remote_generator_falls_back_to_chat_on_a_chat_only_server(streamed, remote):
    assert remote.mode == "chat"  # ragbudget serves no token-id /v1/completions


def test_remote_stream_yields_only_non_empty_text_chunks(streamed):
    events, stats = streamed["events"], streamed["stats"]
    assert len(events) >= 2 and all(e.text for e in events)
    assert streamed["text"].strip()
    assert stats.finish_reason in ("stop", "length") and stats.error is None
    assert stats.usage is not None and 1 <= stats.usage["completion_tokens"] <= MAX_NEW


def test_remote_ttft_and_tpot_are_measured_client_side(streamed, remote):
    events, stats = streamed["events"], streamed["stats"]
    ttft_ms = (stats.first_text_t - stats.start_t) * 1000.0
    total_ms = (stats.last_token_t - stats.start_t) * 1000.0
    assert stats.first_text_t == events[0].t  # the role-only first chunk did not start the clock
    assert stats.prefill_ms == pytest.approx(ttft_ms)
    assert 0 < ttft_ms < total_ms
    assert stats.output_token_ids == remote.tokenizer.encode(streamed["text"])
    assert stats.tpot_ms == pytest.approx((total_ms - ttft_ms) / (stats.output_tokens - 1))
    assert stats.tpot_ms > 0


def test_client_ttft_contains_the_servers_own_ttft(streamed, answer_services):
    """The server's interval (arrival to first token) lies inside the client's (send to first chunk)."""
    from receipts.chain import get_receipt, list_receipts

    page, _ = list_receipts(answer_services.engine, limit=20)
    bodies = [get_receipt(answer_services.engine, r["id"]) for r in page]
    mine = [b for b in bodies if b["output"]["text"] == streamed["text"]
            and b["generator"]["backend"] == "local"]
    assert mine, "the server wrote no receipt for the remote request"
    stats = streamed["stats"]
    assert (stats.first_text_t - stats.start_t) * 1000.0 >= mine[0]["timings"]["ttft_ms"]

