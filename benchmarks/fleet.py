"""A fleet of real engines: round-robin, least predicted TTFT and the joint choice, side by side.

Two (``--engines``) llama.cpp native servers (``llama-server``, one slot, one thread each, each
pinned to its own core with ``taskset``), serving the packaged SmolLM2 GGUF, are one
ragbudget replica's engines (``RAGBUDGET_ENGINES``). Each engine's profile is fitted on that
engine over a small grid (real timed requests). ``--clients`` closed-loop clients each ask
``--rounds`` questions (the project's operational questions and the book index's, on the
corpus ingested in ``RAGBUDGET_DATA_DIR``) with each budget of ``--budgets``, through the
answer pipeline, in three arms over the same servers:

* ``rr``: round-robin over the engines at a fixed k (what a plain load balancer does);
* ``least``: the engine with the least predicted p95 TTFT (its wait plus the prefill) at the
  fixed k (llm-d's predicted-latency routing);
* ``joint``: the fleet planner's engine and k (``latency_model.fleet.choose``), k chosen again
  on the engine when the request gets a place (late binding).

The fixed k of ``rr`` and ``least`` is, per budget, the k the planner gives the first question
on an idle engine (an operator's best static setting), at least 1 so they carry context. The
joint arm asks to be refused fast (``on_budget_miss: reject``, 503 with Retry-After) when no
engine can make k = 0; the baselines cannot refuse. With ``--flood ENGINE`` another client
sends long completions straight to that engine (not through ragbudget) during every arm.

With ``--kill ENGINE`` a fourth arm, ``kill``, runs the joint choice (refusing fast) at the
largest budget while that engine's server is killed (SIGKILL) ``--kill-after-s`` seconds in,
and started again on the same port ``--down-s`` seconds later; the clients ask questions back to
back until ``--after-s`` seconds after the engine is back in rotation. Every request is counted
as answered within budget, answered over budget, refused fast (raised before generation, with
its code), ended with an error code and its receipt, ended with an error and no receipt, or an
unexpected exception, plus clients still hanging at the end; then ``ragbudget receipts verify``
runs on the store (a subprocess, as an operator runs it) and the receipts the arm wrote are
counted against the answers it gave.

Per arm and budget: share of answered requests within the budget, share refused fast, mean k,
goodput (answers within budget per minute), TTFT p50/p95, each engine's share of the answers.

    RAGBUDGET_DATA_DIR=bench-data python -m benchmarks.fleet --clients 4 --rounds 3 \\
        --budgets 1500 3000 --json benchmarks/results/fleet.json [--flood a] [--kill a]
    RAGBUDGET_DATA_DIR=bench-data python -m benchmarks.fleet --arms --kill a --clients 3 \\
        --budgets 3000 --max-new-tokens 8          # the kill arm alone
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import machine_line, quantile_or_none

ARMS = ("rr", "least", "joint")
ALIAS = "smollm2-135m-instruct-q4_1"


def _flood(url: str, stop: threading.Event) -> list[threading.Thread]:
    """Two client threads sending long completions straight to ``url`` until ``stop``."""
    from ragbudget_testing.llama_server import flood

    return flood(url, stop, model=ALIAS, max_tokens=256)


def run_arm(pipe: Any, arm: str, fixed_k: dict[float, int], questions: list[str], budgets: list[float],
            clients: int, rounds: int, max_new_tokens: int) -> list[dict[str, Any]]:
    """Every client asks ``rounds`` questions at each budget (closed loop); one row per answer."""
    from app.answering.state import AnswerRequest
    from foundation.errors import RagBudgetError

    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    pipe.routing = {"rr": "round_robin", "least": "least_ttft", "joint": "joint"}[arm]

    def client(c: int, budget: float) -> None:
        for r in range(rounds):
            q = questions[(c * rounds + r) % len(questions)]
            t0 = time.perf_counter()
            try:
                a = pipe.answer(AnswerRequest(q, ttft_budget_ms=budget, max_new_tokens=max_new_tokens,
                                              on_budget_miss="reject" if arm == "joint" else "answer"))
                row = {"arm": arm, "budget_ms": budget, "status": a.status, "ttft_ms": a.timings.ttft_ms,
                       "k": a.chosen_k, "engine": a.predicted.engine_id, "within": a.within_budget}
            except RagBudgetError as exc:
                row = {"arm": arm, "budget_ms": budget, "status": exc.code, "ttft_ms": None, "k": None,
                       "engine": None, "within": False}
            row["wall_ms"] = (time.perf_counter() - t0) * 1000.0
            with lock:
                rows.append(row)

    for budget in budgets:
        pipe.fixed_k = None if arm == "joint" else fixed_k[budget]
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c, budget)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        minutes = (time.perf_counter() - t0) / 60.0
        for row in rows:
            if row["arm"] == arm and row["budget_ms"] == budget:
                row["run_minutes"] = minutes
    pipe.fixed_k = None
    return rows


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


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm and budget: within budget, mean k, goodput, TTFT p50/p95, engine shares."""
    out: dict[str, Any] = {}
    for arm in ARMS:
        for budget in sorted({r["budget_ms"] for r in rows}):
            sel = [r for r in rows if r["arm"] == arm and r["budget_ms"] == budget]
            if not sel:
                continue
            answered = [r for r in sel if r["engine"]]
            ttfts = [r["ttft_ms"] for r in answered if r["ttft_ms"] is not None]
            ks = [r["k"] for r in answered if r["k"] is not None]
            within = sum(1 for r in answered if r["within"])
            engines = Counter(r["engine"] for r in answered)
            out[f"{arm}@{budget:.0f}"] = {
                "requests": len(sel), "answers": len(answered),
                "within_budget": within / len(answered) if answered else None,
                "refused_fast": sum(1 for r in sel if r["status"] == "budget_unreachable") / len(sel),
                "mean_k": sum(ks) / len(ks) if ks else None,
                "goodput_per_min": within / sel[0]["run_minutes"],
                "ttft_p50_ms": quantile_or_none(ttfts, 0.5), "ttft_p95_ms": quantile_or_none(ttfts, 0.95),
                "engine_share": {e: n / len(answered) for e, n in sorted(engines.items())},
                "statuses": dict(Counter(r["status"] for r in sel))}
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table (and write ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budgets", type=float, nargs="+", default=[1500.0, 3000.0])
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--flood", default=None, help="engine id another client floods directly")
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS,
                    help="the routing arms to run (none: only the kill arm)")
    ap.add_argument("--kill", default=None, help="engine id killed and restarted in the kill arm")
    ap.add_argument("--kill-after-s", type=float, default=10.0)
    ap.add_argument("--down-s", type=float, default=10.0)
    ap.add_argument("--after-s", type=float, default=10.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from app.answering.pipeline import AnswerPipeline
    from app.profile_store import save_profile
    from app.services import Services
    from app.settings import get_settings
    from app.sweep import default_questions
    from generation.assets import ensure_packaged_generator, packaged_gguf_path
    from latency_model.calibration import calibrate
    from latency_model.grid import quick_grid
    from ragbudget_testing.llama_server import NativeLlamaServer

    base = get_settings()
    smollm = ensure_packaged_generator(base.data_dir)
    cores = sorted(os.sched_getaffinity(0))
    ids = [chr(ord("a") + i) for i in range(args.engines)]
    logs = Path(tempfile.mkdtemp(prefix="ragbudget-fleet-"))
    servers = {}
    try:
        for i, eid in enumerate(ids):
            servers[eid] = NativeLlamaServer(packaged_gguf_path(), logs / f"{eid}.log", alias=ALIAS,
                                             n_ctx=args.n_ctx, threads=1, parallel=1,
                                             cpus=[cores[i % len(cores)]]).start()
        engines = [{"id": eid, "kind": "remote", "base_url": s.base_url, "model": ALIAS,
                    "tokenizer": str(smollm), "context_window": args.n_ctx} for eid, s in servers.items()]
        services = Services(get_settings(engines=engines))
        grid = dataclasses.replace(quick_grid(args.n_ctx, [0]), repeats=1, short_repeats=1,
                                   long_repeats=1, warmup=2, fresh_points=8)
        for eid in ids:
            save_profile(services.engine, services.data_dir,
                         calibrate(services.engine_generator(eid), grid=grid, seed=0, progress=False))
        pipe = AnswerPipeline(services)
        pipe.warm()
        questions = [q["question"] for q in default_questions(services.data_dir, 10, 0)]
        from app.answering.state import AnswerRequest

        fixed_k = {b: max(int(pipe.prepare(AnswerRequest(questions[0], ttft_budget_ms=b)).plan.chosen_k
                                  or 0), 1) for b in args.budgets}
        stop = threading.Event()
        flood = _flood(servers[args.flood].base_url, stop) if args.flood else []
        rows: list[dict[str, Any]] = []
        kill: dict[str, Any] | None = None
        try:
            for arm in args.arms:
                rows += run_arm(pipe, arm, fixed_k, questions, args.budgets, args.clients, args.rounds,
                                args.max_new_tokens)
            if args.kill:
                from receipts.verify import verify_chain

                before = verify_chain(services.engine).checked
                kill_rows, events = run_kill_arm(pipe, servers[args.kill], args.kill, questions,
                                                 max(args.budgets), args.clients, args.max_new_tokens,
                                                 args.kill_after_s, args.down_s, args.after_s)
                rows += kill_rows
                kill = summarise_kill(pipe, kill_rows, events, args.kill, receipts_verify(), before)
        finally:
            stop.set()
            for t in flood:
                t.join(600)
        summary = summarise(rows)
        result = {"machine": machine_line(), "engines": len(ids), "pinned": "one core each (taskset)",
                  "clients": args.clients, "rounds": args.rounds, "budgets": args.budgets,
                  "max_new_tokens": args.max_new_tokens, "fixed_k": {str(k): v for k, v in fixed_k.items()},
                  "flood": args.flood, "summary": summary, "kill": kill, "rows": rows}
        print(machine_line())
        print(f"fixed k (rr, least): {fixed_k}; flood: {args.flood}")
        print(f"{'arm@budget':<14} {'n':>3} {'within':>7} {'refused':>7} {'mean k':>7} "
              f"{'goodput/min':>11} {'p50 ms':>8} {'p95 ms':>8}  engines")
        for name, s in summary.items():
            print(f"{name:<14} {s['requests']:>3} {s['within_budget'] or 0.0:>7.0%} "
                  f"{s['refused_fast']:>7.0%} "
                  f"{(s['mean_k'] if s['mean_k'] is not None else float('nan')):>7.2f} "
                  f"{s['goodput_per_min']:>11.1f} {s['ttft_p50_ms'] or float('nan'):>8.0f} "
                  f"{s['ttft_p95_ms'] or float('nan'):>8.0f}  {s['engine_share']}")
        if kill is not None:
            print(f"kill arm (engine {args.kill} killed at {kill['events_s'].get('killed_s')} s, restarted "
                  f"at {kill['events_s'].get('restarted_s')} s, back in rotation at "
                  f"{kill['events_s'].get('rejoined_s')} s; budget {max(args.budgets):.0f} ms):")
            for key in ("requests", "answered_within_budget", "answered_over_budget", "refused_fast",
                        "refused_codes", "refused_wall_ms_max", "failed_with_receipt", "failed_codes",
                        "failed_without_receipt", "unexpected", "hung_clients", "retried_elsewhere",
                        "answers_with_receipt", "receipts_written", "receipts_verify_ok",
                        "victim_answers_by_phase", "requests_by_phase"):
                print(f"  {key:<24} {kill[key]}")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
        pipe.close()
        services.close()
    finally:
        for s in servers.values():
            s.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
