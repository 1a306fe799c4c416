"""The kill phase of the fleet benchmark (``benchmarks/fleet.py --kill ENGINE``).

The joint choice (refusing fast) at one budget while one engine's server is killed with SIGKILL
``kill_after_s`` seconds in and started again on the same port ``down_s`` seconds later; the
clients ask questions back to back until ``after_s`` seconds after the engine is back in
rotation (its background probe, :class:`app.fleet.EngineHealth`). Every request is counted as
answered within budget, answered over budget, refused fast (raised before generation, with its
code), ended with an error code and its receipt, ended with an error and no receipt, or an
unexpected exception, plus clients still hanging at the end; then ``ragbudget receipts verify``
runs on the store (a subprocess, as an operator runs it) and the receipts the phase wrote are
counted against the answers it gave.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any


def run_kill_arm(pipe: Any, server: Any, victim: str, questions: list[str], budget: float, clients: int,
                 max_new_tokens: int, kill_after_s: float, down_s: float,
                 after_s: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The joint choice while ``server`` (engine ``victim``) is killed and restarted (see the module
    docstring). Returns one row per request and the event times (s from the arm's start:
    ``killed_s``, ``restarted_s``, ``rejoined_s``; ``hung_clients``)."""
    from app.answering.state import AnswerRequest
    from foundation.errors import RagBudgetError

    pipe.routing, pipe.fixed_k = "joint", None
    rows: list[dict[str, Any]] = []
    lock, stop = threading.Lock(), threading.Event()
    events: dict[str, Any] = {}
    t0 = time.perf_counter()

    def phase() -> str:
        return "after" if "rejoined_s" in events else "down" if "killed_s" in events else "before"

    def client(c: int) -> None:
        i = 0
        while not stop.is_set():
            q, i = questions[(c * 7 + i) % len(questions)], i + 1
            t = time.perf_counter()
            row: dict[str, Any] = {"arm": "kill", "budget_ms": budget, "phase": phase(), "t_s": t - t0}
            try:
                a = pipe.answer(AnswerRequest(q, ttft_budget_ms=budget, max_new_tokens=max_new_tokens,
                                              on_budget_miss="reject"))
                row.update(status=a.status, error=a.error.code if a.error else None,
                           ttft_ms=a.timings.ttft_ms, k=a.chosen_k, engine=a.predicted.engine_id,
                           within=bool(a.within_budget), receipt_id=a.receipt_id,
                           receipt_status=a.receipt_status)
            except RagBudgetError as exc:
                row.update(status="refused", error=exc.code, ttft_ms=None, k=None, engine=None,
                           within=False, receipt_id=None)
                # as an HTTP client honours Retry-After: come back when the refusal says
                wait_s = getattr(exc, "retry_after_s", None) or exc.details.get("retry_after_s")
                if isinstance(wait_s, int | float) and wait_s > 0:
                    stop.wait(min(float(wait_s), 5.0))
            except Exception as exc:  # counted, never hidden: the arm's point is that none occur
                row.update(status="unexpected", error=repr(exc)[:200], ttft_ms=None, k=None, engine=None,
                           within=False, receipt_id=None)
            row["wall_ms"] = (time.perf_counter() - t) * 1000.0
            with lock:
                rows.append(row)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    time.sleep(kill_after_s)
    assert server.proc is not None
    server.proc.kill()  # SIGKILL: no goodbye to the connections it holds
    server.proc.wait(30)
    events["killed_s"] = time.perf_counter() - t0
    time.sleep(down_s)
    server.start()  # the same port
    events["restarted_s"] = time.perf_counter() - t0
    engine = pipe.engines[victim]
    deadline = time.perf_counter() + 120.0
    while not engine.healthy and time.perf_counter() < deadline:
        time.sleep(0.05)
    if engine.healthy:
        events["rejoined_s"] = time.perf_counter() - t0
    time.sleep(after_s)
    stop.set()
    for t in threads:
        t.join(300)
    events["hung_clients"] = sum(t.is_alive() for t in threads)
    events["downs"] = engine.health.downs
    return rows, events


def summarise_kill(pipe: Any, rows: list[dict[str, Any]], events: dict[str, Any], victim: str,
                   verify: dict[str, Any], receipts_before: int) -> dict[str, Any]:
    """The kill arm's counts (see the module docstring) and what the receipts say."""
    from receipts.chain import get_receipt_row, parse_body

    answered = [r for r in rows if r["status"] in ("ok", "cancelled")]
    failed = [r for r in rows if r["status"] == "failed"]
    refused = [r for r in rows if r["status"] == "refused"]
    def has_receipt(r: dict[str, Any]) -> bool:
        return bool(r.get("receipt_id")) and r.get("receipt_status") in ("written", "pending")

    with_receipt = [r for r in rows if has_receipt(r)]
    retried = 0
    for r in with_receipt:
        if r.get("receipt_status") == "written":
            body = parse_body(get_receipt_row(pipe.services.engine, r["receipt_id"]).body)
            retried += bool((body["plan"].get("fleet") or {}).get("retried_from"))
    return {
        "requests": len(rows),
        "answered_within_budget": sum(1 for r in answered if r["within"]),
        "answered_over_budget": sum(1 for r in answered if not r["within"]),
        "refused_fast": len(refused),
        "refused_codes": dict(Counter(r["error"] for r in refused)),
        "refused_wall_ms_max": max((r["wall_ms"] for r in refused), default=None),
        "failed_with_receipt": sum(1 for r in failed if has_receipt(r)),
        "failed_codes": dict(Counter(r["error"] for r in failed)),
        "failed_without_receipt": sum(1 for r in failed if not has_receipt(r)),
        "unexpected": sum(1 for r in rows if r["status"] == "unexpected"),
        "hung_clients": events.get("hung_clients"),
        "retried_elsewhere": retried,
        "receipts_written": verify.get("checked", 0) - receipts_before,
        "answers_with_receipt": len(with_receipt),
        "receipts_verify_ok": bool(verify.get("ok")),
        "victim_answers_by_phase": {ph: sum(1 for r in answered if r["engine"] == victim and r["phase"] == ph)
                                    for ph in ("before", "down", "after")},
        "requests_by_phase": dict(Counter(r["phase"] for r in rows)),
        "events_s": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in events.items()},
    }


def receipts_verify() -> dict[str, Any]:
    """``ragbudget receipts verify --json`` in a subprocess, on this process's settings (its
    environment); its parsed report (``ok``, ``checked``, ...) and exit code."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "app.cli.main", "receipts", "verify", "--json"],
                          capture_output=True, text=True, timeout=600)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        report = {"ok": False, "stdout": proc.stdout[-500:], "stderr": proc.stderr[-500:]}
    report["returncode"] = proc.returncode
    return report


