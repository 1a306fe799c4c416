"""What every ``benchmarks/load.py`` run shares: the app served over loopback HTTP, one answer
request as a client sees it, a cell of closed- or open-loop clients, the pipeline's arm switches.

A client that is refused fast (503 ``budget_unreachable``) is told when to come back
(``Retry-After``, seconds); a closed-loop client waits that long before its next request, as a
well-behaved copilot would (``retry_immediately=True``: it asks again at once, how runs before
2026-12-03 behaved, which counts one busy spell as many refusals). Open-loop arrivals never retry.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from benchmarks.common import elapsed_ms, machine


def set_arm(pipeline: Any, arm: str) -> None:
    """Flip the pipeline's switches for ``arm`` (one of :data:`ARMS`)."""
    pipeline.late_binding = pipeline.online_correction = arm != "off"
    pipeline.live_speed = arm in ("on", "on-greedy", "on-floor")
    pipeline.room_for_arrivals = arm in ("on", "on-answers", "on-floor")
    pipeline.switches.residual_band = arm != "on-floor"


class Server:
    """An app served by uvicorn in a thread of this process, on a free loopback port."""

    def __init__(self, app: Any) -> None:
        import socket

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Ask uvicorn to exit and wait (up to 15 s) for its thread."""
        self.server.should_exit = True
        self.thread.join(15)


def post_answer(client: Any, url: str, question: str, budget: float, tokens: int,
                headers: dict[str, str], on_budget_miss: str = "reject") -> dict[str, Any]:
    """One ``POST /v1/answer``; the client's view (status, wall time ``client_ms``) plus the
    answer's own numbers (ms), or for a refusal its error code, predicted TTFT, where it was
    refused and ``retry_after_s`` (the ``Retry-After`` header, seconds; None when absent)."""
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/answer", headers=headers, timeout=600,
                    json={"question": question, "ttft_budget_ms": budget, "max_new_tokens": tokens,
                          "on_budget_miss": on_budget_miss})
    wall = elapsed_ms(t0)
    row: dict[str, Any] = {"status": r.status_code, "client_ms": wall}
    if r.status_code == 200:
        a = r.json()
        t, p = a["timings"], a["predicted"]
        row.update(ttft_ms=t["ttft_ms"], queue_ms=t["queue_ms"], prefill_ms=t["prefill_ms"],
                   tpot_ms=t["tpot_ms"], end_t=time.perf_counter(),
                   auth_ms=t.get("auth_ms"), overhead_ms=t["overhead_ms"], k=a["chosen_k"],
                   binding=a["binding"], within=a["within_budget"], cause=a["budget_miss_cause"],
                   predicted_wait_ms=p["wait_ms"], predicted_p95_ms=p["ttft_p95_ms"],
                   predicted_p50_ms=p["ttft_p50_ms"], p95_multiplier=p.get("p95_multiplier"),
                   correction_group=p.get("correction_group"), prompt_tokens=a["tokens"]["prompt"],
                   correction_factor=p["correction_factor"], machine_speed=p.get("machine_speed"),
                   tokens_out=a["tokens"]["output"], cached_tokens=a["tokens"]["cached"],
                   prefill_p50_ms=p.get("prefill_p50_ms"), batch=p.get("batch"))
    else:
        err = r.json().get("error", {})
        details = err.get("details") or {}
        retry = r.headers.get("retry-after")
        row.update(code=err.get("code"), predicted_ttft_ms=details.get("predicted_ttft_ms"),
                   where=details.get("where"), retry_after_s=float(retry) if retry else None)
    return row


def run_cell(url: str, load: str, budget: float, tokens: int, n: int, questions: list[str],
             rng: random.Random, headers: dict[str, str],
             on_budget_miss: str = "reject", retry_immediately: bool = False) -> list[dict[str, Any]]:
    """``n`` requests under ``load`` (``closed-C``: C clients, each asking again once it has its
    answer, or once the ``Retry-After`` of a refusal has passed unless ``retry_immediately``;
    ``poisson-R``: arrivals at R per second); rows in completion order, each with its index ``i``."""
    import httpx

    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    todo = list(range(n))
    qs = [questions[rng.randrange(len(questions))] for _ in range(n)]

    def ask(i: int, client: Any) -> dict[str, Any]:
        row = post_answer(client, url, qs[i], budget, tokens, headers, on_budget_miss)
        row["i"] = i
        with lock:
            rows.append(row)
        return row

    if load.startswith("closed-"):
        clients = int(load.split("-")[1])

        def worker() -> None:
            with httpx.Client() as client:
                while True:
                    with lock:
                        if not todo:
                            return
                        i = todo.pop(0)
                    row = ask(i, client)
                    if row["status"] == 503 and row.get("retry_after_s") and not retry_immediately:
                        time.sleep(float(row["retry_after_s"]))  # as the server asked

        threads = [threading.Thread(target=worker) for _ in range(clients)]
    else:
        rate = float(load.split("-")[1])
        gaps = [rng.expovariate(rate) for _ in range(n)]

        def arrive(i: int, delay: float) -> None:
            time.sleep(delay)
            with httpx.Client() as client:
                ask(i, client)

        at = 0.0
        threads = []
        for i, g in enumerate(gaps):
            at += g if i else 0.0
            threads.append(threading.Thread(target=arrive, args=(i, at)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


def build(auth: bool = False) -> tuple[Any, Any, list[str]]:
    """``(services, app, questions)``: the configured data directory's services, the API app on
    them (warmed), and the ten default sweep questions of the corpus. ``auth``: key checks on."""
    from app.api.app import create_app
    from app.services import Services
    from app.settings import get_settings
    from app.sweep import default_questions

    services = Services(get_settings(auth_enabled=auth))
    app = create_app(services=services)
    app.state.pipeline.warm()
    questions = [q["question"] for q in default_questions(services.data_dir, 10, 0)]
    return services, app, questions


def run_header(services: Any, app: Any) -> dict[str, Any]:
    """The ``kind: run`` row that opens each run in ``--out``: profile, model, machine, load."""
    prof = app.state.pipeline.profile()
    return {"kind": "run", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "profile": prof.id, "profile_source": prof.source,
            "model": services.generator.identity.get("model_id"),
            "threads": services.generator.identity.get("threads"),
            **machine()}
