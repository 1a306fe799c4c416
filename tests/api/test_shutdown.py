"""SIGTERM during streaming answers: the server exits within RAGBUDGET_SHUTDOWN_GRACE_S + 1 s and
every answer that reached a client has a receipt (ok or cancelled); the chain verifies.
The server is a subprocess (tests/api/fake_server.py); every wait is bounded."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import select

from foundation.db import make_engine, read_session
from receipts.models import ReceiptRow
from receipts.verify import verify_chain

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sigterm_during_three_streaming_answers_exits_within_grace_with_three_receipts(tmp_path):
    port = _free_port()
    env = {**os.environ, "RAGBUDGET_SHUTDOWN_GRACE_S": str(GRACE_S)}
    env.pop("RAGBUDGET_DATABASE_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "tests.api.fake_server", str(tmp_path), str(port)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        got_bytes = [threading.Event() for _ in range(3)]

        def ask(i: int) -> None:
            body = {"question": f"what colour is the pump {i}", "ttft_budget_ms": 60_000, "stream": True,
                    "max_new_tokens": 1000}
            try:
                # The two queued answers send no byte until they get the model: a read timeout
                # longer than the test, so no client leaves before the signal.
                with httpx.stream("POST", f"{base}/v1/answer", json=body,
                                  timeout=httpx.Timeout(10.0, read=120.0)) as r:
                    for _ in r.iter_bytes():
                        got_bytes[i].set()
            except httpx.HTTPError:
                pass

        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        # One generation runs at a time: the first answer streams, the other two wait in the queue.
        first_bytes_by = time.monotonic() + 30
        while not any(e.is_set() for e in got_bytes):
            assert time.monotonic() < first_bytes_by, "no answer started streaming"
            time.sleep(0.05)
        streaming = [e.is_set() for e in got_bytes]
        time.sleep(3.0)  # let the queued two get past retrieval and planning into the queue
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=GRACE_S + 30)
        elapsed = time.monotonic() - t0
        assert elapsed <= GRACE_S + 1.0, (elapsed, out[-2000:])
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    engine = make_engine(f"sqlite:///{tmp_path / 'api.db'}")
    try:
        with read_session(engine) as s:
            statuses = [r for (r,) in s.execute(select(ReceiptRow.status).order_by(ReceiptRow.seq))]
        assert set(statuses) <= {"ok", "cancelled"} and statuses, statuses
        assert verify_chain(engine).ok
        # The streaming answer (1000 tokens at 50 ms each) was still running at the signal and
        # the other two were waiting for the model: all three are cancelled, each with its receipt.
        assert statuses == ["cancelled"] * 3, statuses
        assert streaming.count(True) == 1
    finally:
        engine.dispose()
