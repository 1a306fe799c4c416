"""``python -m benchmarks.load --batching``: batched vs one-at-a-time answers and the engine-setting sweep."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import append_jsonl, quantile_or_none
from benchmarks.load_http import Server, build, run_cell, run_header
from benchmarks.load_report import BATCH_ARMS, batching_report, engine_sweep_report


def batching(args: argparse.Namespace) -> int:
    """Batched vs one-at-a-time answers through HTTP, same run (``--batching``).

    Closed loop at each of ``--clients`` (every client asks again as soon as it has its
    answer), ``--per-client`` answers each, ``--budget`` ms, ``--tokens`` new tokens,
    ``on_budget_miss: answer`` (every request is answered, late ones flagged). Arm
    ``batched``: the engine's configured ``max_running``; ``serial``: ``max_running = 1``
    (one answer at a time, the rest wait), the same questions. Late binding and the online
    correction stay on in both. Per cell: goodput (answers within budget per minute of the
    cell's wall time), TTFT p50/p95, mean TPOT, and the ratios the issue's goals are stated in.
    """
    services, app, questions = build(auth=args.with_key)
    headers: dict[str, str] = {}
    if args.with_key:  # every request carries a copilot key, checked inside the TTFT clock
        from app.auth import create_key

        headers = {"Authorization": f"Bearer {create_key(services.engine, 'copilot', 'load benchmark')[1]}"}
    engine = services.generator.engine
    configured = int(engine.max_running)
    configured_budget = int(engine.step_token_budget)
    if args.engine_sweep:
        return engine_sweep(args, services, app, questions, headers, engine, configured, configured_budget)
    server = Server(app)
    out: Path = args.out
    header = run_header(services, app)
    header.update(kind="batching-run", max_running=configured, auth=args.with_key)
    results: dict[tuple[int, str], dict[str, Any]] = {}
    append_jsonl(out, [header])
    for clients in [int(c) for c in args.clients.split(",")]:
        for arm in BATCH_ARMS:
            engine.max_running = configured if arm == "batched" else 1
            cell_rng = random.Random(f"{args.seed}-batching-{clients}")  # same questions per arm
            t0 = time.perf_counter()
            rows = run_cell(server.url, f"closed-{clients}", args.budget, args.tokens,
                            clients * args.per_client, questions, cell_rng, headers, "answer")
            wall_s = time.perf_counter() - t0
            ok = [r for r in rows if r["status"] == 200]
            ttft = [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None]
            tpot = [r["tpot_ms"] for r in ok if r.get("tpot_ms") is not None]
            cell = {"kind": "batching", "clients": clients, "arm": arm, "budget": args.budget,
                    "tokens": args.tokens, "requests": len(rows), "answered": len(ok),
                    "within": sum(1 for r in ok if r["within"]), "wall_s": wall_s,
                    "goodput_per_min": 60.0 * sum(1 for r in ok if r["within"]) / wall_s,
                    "answers_per_min": 60.0 * len(ok) / wall_s,
                    "ttft_p50": quantile_or_none(ttft, 0.5), "ttft_p95": quantile_or_none(ttft, 0.95),
                    "tpot_mean": statistics.fmean(tpot) if tpot else None,
                    "tokens_out_mean": statistics.fmean(r["tokens_out"] for r in ok) if ok else None,
                    "k_mean": statistics.fmean(r["k"] for r in ok) if ok else None,
                    "loadavg": os.getloadavg(), "rows": rows}
            results[(clients, arm)] = cell
            append_jsonl(out, [cell])
            print(f"{clients} clients {arm:>7}: {cell['within']}/{len(rows)} within budget, "
                  f"goodput {cell['goodput_per_min']:.1f}/min, TTFT p95 {cell['ttft_p95']}, "
                  f"TPOT {cell['tpot_mean']} ({wall_s:.0f} s)", file=sys.stderr, flush=True)
    engine.max_running = configured
    server.stop()
    services.close()
    print(batching_report(list(results.values())))
    return 0


def engine_sweep(args: argparse.Namespace, services: Any, app: Any, questions: list[str],
                 headers: dict[str, str], engine: Any, configured: int, configured_budget: int) -> int:
    """``--batching --engine-sweep RxB,...``: the batched arm only, once per engine setting
    (``R`` = max running answers, ``B`` = per-step token budget), at each of ``--clients``,
    rounds interleaved (settings rotated per round, ``--rounds``), the same questions for every
    setting of a client count. Reported per setting: goodput, TTFT p50/p95, TPOT, mean k."""
    settings = [tuple(int(v) for v in item.lower().split("x")) for item in args.engine_sweep.split(",")]
    server = Server(app)
    header = run_header(services, app)
    header.update(kind="engine-sweep-run", settings=settings, auth=args.with_key)
    cells: list[dict[str, Any]] = []
    append_jsonl(args.out, [header])
    for rnd in range(args.rounds):
        order = settings[rnd % len(settings):] + settings[:rnd % len(settings)]
        for clients in [int(c) for c in args.clients.split(",")]:
            for running, budget in order:
                engine.max_running, engine.step_token_budget = running, budget
                cell_rng = random.Random(f"{args.seed}-sweep-{clients}-{rnd}")
                t0 = time.perf_counter()
                rows = run_cell(server.url, f"closed-{clients}", args.budget, args.tokens,
                                clients * args.per_client, questions, cell_rng, headers, "answer")
                wall_s = time.perf_counter() - t0
                ok = [r for r in rows if r["status"] == 200]
                cell = {"kind": "engine-sweep", "round": rnd, "clients": clients, "max_running": running,
                        "step_token_budget": budget, "budget": args.budget, "tokens": args.tokens,
                        "requests": len(rows), "answered": len(ok),
                        "within": sum(1 for r in ok if r["within"]), "wall_s": wall_s,
                        "loadavg": os.getloadavg(), "rows": rows}
                cells.append(cell)
                append_jsonl(args.out, [cell])
                print(f"round {rnd} {clients} clients {running}x{budget}: {cell['within']}/{len(rows)} "
                      f"within budget ({wall_s:.0f} s)", file=sys.stderr, flush=True)
    engine.max_running, engine.step_token_budget = configured, configured_budget
    server.stop()
    services.close()
    print(engine_sweep_report(cells))
    return 0
