"""The TTFT budget under concurrent load: late binding + online correction on vs off, same run.

One process loads the services once (the configured data directory: the real
corpus and its fitted profile) and serves the real app over HTTP with uvicorn
on a loopback port; client threads post ``POST /v1/answer`` with
``on_budget_miss: reject``. Cells: load (closed loop with 1, 2 and 4 clients,
each client asking again as soon as it has its answer; open loop with Poisson
arrivals at two rates) x budget (800, 1500, 3000 ms) x new tokens (32, 64) x arm
(``on``: late binding and online correction following the machine speed read from the
engine's steps, and room left for requests that arrived meanwhile; ``on-answers``: the same,
the correction learned from answers alone, live speed off; ``on-greedy``: ``on`` but each answer
binds as if no one came after it (``room_for_arrivals`` off); ``off``: late binding and
correction switched off on the same pipeline), the arms of a cell (``--arms``, default
``on,off``) run one after the other. Per cell:
share of answered requests within budget, share rejected fast (503
``budget_unreachable``), mean budget used (TTFT / budget, answered), TTFT
p50/p95 and queue p95 (answered). Each answer is one line of ``--out`` (jsonl);
a rerun skips cells already complete, so the run resumes after an interruption.

``--hog``: the coverage run instead. After ``--warmup`` answers on the quiet
machine, one busy process (a pure-Python loop, one core) is started and
``--after`` answers follow one at a time; per answer, is the measured prefill
(model granted to first token) within the predicted p95 prefill, with the
online correction (what the plan used: learned from answers and scaled to the machine
speed read from the engine's latest steps), with the correction learned from answers
alone (its state when the request was planned, no live speed) and with the fitted
profile alone (the same answer, predicted without correction). Reported: coverage over
answers 1-10, 11-20, 1-20 and 21-40 after the hog started.

``--auth``: ``POST /v1/retrieve`` over HTTP, alternately to an app with a key
check and to one without (same services, same process, same run); p50/p95 of
each and the difference.

``--batching --engine-sweep 4x256,8x256,...``: the batched arm only, once per engine
setting (max running answers x per-step token budget), settings rotated per round.

``--batching``: batched vs one-at-a-time answers, same run (closed loop at
``--clients``, the engine's ``max_running`` vs 1, same questions per cell):
goodput (answers within budget per minute), TTFT p50/p95, TPOT and the ratios
of the goals (4 clients vs serial, and vs 1 client).

    cp -a /work/data/mainjob /tmp/lb-data   # never write into the prepared directory
    RAGBUDGET_DATA_DIR=/tmp/lb-data flock /tmp/ragbudget-cpu.lock \\
        python benchmarks/load.py --out docs/load.jsonl --per-cell 8
    python benchmarks/load.py --out docs/load.jsonl --report   # the markdown table
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.load_report import (  # noqa: E402
    ARMS,
    BATCH_ARMS,
    batching_report,
    engine_sweep_report,
    pct,
    read_rows,
    report,
    summarise,
)

BUDGETS = (800.0, 1500.0, 3000.0)
TOKENS = (32, 64)


def _set_arm(pipeline: Any, arm: str) -> None:
    """Flip the pipeline's switches for ``arm`` (one of :data:`ARMS`)."""
    pipeline.late_binding = pipeline.online_correction = arm != "off"
    pipeline.live_speed = arm in ("on", "on-greedy")
    pipeline.room_for_arrivals = arm in ("on", "on-answers")


def _loads(rates: list[float]) -> list[str]:
    return ["closed-1", "closed-2", "closed-4"] + [f"poisson-{r:g}" for r in rates]


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
        self.server.should_exit = True
        self.thread.join(15)


def _one(client: Any, url: str, question: str, budget: float, tokens: int,
         headers: dict[str, str], on_budget_miss: str = "reject") -> dict[str, Any]:
    """One answer request; the client's view (status, wall time) plus the answer's own numbers."""
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/answer", headers=headers, timeout=600,
                    json={"question": question, "ttft_budget_ms": budget, "max_new_tokens": tokens,
                          "on_budget_miss": on_budget_miss})
    wall = (time.perf_counter() - t0) * 1000.0
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
        row.update(code=err.get("code"), predicted_ttft_ms=details.get("predicted_ttft_ms"),
                   where=details.get("where"))
    return row


def run_cell(url: str, load: str, budget: float, tokens: int, n: int, questions: list[str],
             rng: random.Random, headers: dict[str, str],
             on_budget_miss: str = "reject") -> list[dict[str, Any]]:
    """``n`` answers under ``load``; rows in completion order."""
    import httpx

    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    todo = list(range(n))
    qs = [questions[rng.randrange(len(questions))] for _ in range(n)]

    def ask(i: int, client: Any) -> None:
        row = _one(client, url, qs[i], budget, tokens, headers, on_budget_miss)
        row["i"] = i
        with lock:
            rows.append(row)

    if load.startswith("closed-"):
        clients = int(load.split("-")[1])

        def worker() -> None:
            with httpx.Client() as client:
                while True:
                    with lock:
                        if not todo:
                            return
                        i = todo.pop(0)
                    ask(i, client)

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


def _build(auth: bool = False) -> tuple[Any, Any, list[str]]:
    from app.api.app import create_app
    from app.services import Services
    from app.settings import get_settings
    from app.sweep import default_questions

    services = Services(get_settings(auth_enabled=auth))
    app = create_app(services=services)
    app.state.pipeline.warm()
    questions = [q["question"] for q in default_questions(services.data_dir, 10, 0)]
    return services, app, questions


def _header(services: Any, app: Any) -> dict[str, Any]:
    from foundation.machine import cpu_model

    prof = app.state.pipeline.profile()
    return {"kind": "run", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "profile": prof.id, "profile_source": prof.source,
            "model": services.generator.identity.get("model_id"),
            "threads": services.generator.identity.get("threads"),
            "cpu": cpu_model(), "cores": os.cpu_count(),
            "loadavg": os.getloadavg()}


def grid(args: argparse.Namespace) -> int:
    services, app, questions = _build()
    pipeline = app.state.pipeline
    server = Server(app)
    out: Path = args.out
    done: dict[tuple[str, str, float, int], int] = {}
    for r in read_rows(out):
        if r.get("kind") == "answer":
            key = (r["arm"], r["load"], r["budget"], r["tokens"])
            done[key] = done.get(key, 0) + 1
    rates = [float(x) for x in args.rates.split(",")]
    arms = args.arm_list
    # Token counts outermost, then budgets (1500 first), loads innermost: a run cut short still
    # holds every load at the budgets it reached.
    budgets = sorted(BUDGETS, key=lambda b: (b != 1500.0, b))
    cells = [(load, b, t) for t in TOKENS for b in budgets for load in _loads(rates)
             if (not args.loads or load in args.loads.split(","))
             and (not args.budgets or b in [float(x) for x in args.budgets.split(",")])
             and (not args.tokens_only or t in [int(x) for x in args.tokens_only.split(",")])]
    rng = random.Random(args.seed)
    with out.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(_header(services, app)) + "\n")
        if args.grid_warmup and not done:
            # A server in service has answered before: feed the online correction the
            # machine as it is now (rows kept as kind "warmup", outside every cell).
            _set_arm(pipeline, "on")
            rows = run_cell(server.url, "closed-1", 3000.0, TOKENS[0], args.grid_warmup, questions,
                            random.Random(f"{args.seed}-warmup"), {})
            for r in rows:
                r.update(kind="warmup", arm="on", load="closed-1", budget=3000.0, tokens=TOKENS[0])
                fh.write(json.dumps(r) + "\n")
            fh.flush()
            state = pipeline.correction_state(pipeline.profile().id)
            print(f"warm-up: {len(rows)} answers, correction factor {state.factor:.3f}, "
                  f"p95 multiplier {state.p95_multiplier}", file=sys.stderr, flush=True)
        for load, budget, tokens in cells:
            for arm in arms:
                key = (arm, load, budget, tokens)
                cell_rng = random.Random(f"{args.seed}-{load}-{budget}-{tokens}")  # same questions per arm
                if done.get(key, 0) >= args.per_cell:
                    continue
                _set_arm(pipeline, arm)
                t0 = time.perf_counter()
                rows = run_cell(server.url, load, budget, tokens, args.per_cell, questions, cell_rng, {})
                for r in rows:
                    r.update(kind="answer", arm=arm, load=load, budget=budget, tokens=tokens)
                    fh.write(json.dumps(r) + "\n")
                fh.flush()
                s = summarise(rows, budget)
                print(f"{load:>12} {budget:5.0f} ms {tokens:3d} tok {arm:>10}: answered {s['answered']}/"
                      f"{s['requests']} within {s['within']} rejected {s['rejected']} used {s['used']} "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    del rng
    server.stop()
    services.close()
    print(report(out))
    return 0


def hog(args: argparse.Namespace) -> int:
    import httpx

    services, app, questions = _build()
    pipeline = app.state.pipeline
    _set_arm(pipeline, "on")
    profile = pipeline.profile()
    pipeline.corrections.reset()
    correction = pipeline.corrections.get(profile.id)
    server = Server(app)
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    busy: subprocess.Popen[bytes] | None = None
    try:
        with httpx.Client() as client:
            for i in range(args.warmup + args.after):
                if i == args.warmup:
                    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    time.sleep(1.0)
                q = questions[rng.randrange(len(questions))]
                # What the correction learned from answers alone (no live speed), as it stood
                # when this request was planned: the on-answers arm's band for the same answer.
                answers_state = correction.state(None, False)
                r = client.post(f"{server.url}/v1/answer", timeout=600, json={
                    "question": q, "ttft_budget_ms": args.budget, "max_new_tokens": 8}).json()
                p, t, tok = r["predicted"], r["timings"], r["tokens"]
                corrected_p95 = p["ttft_p95_ms"] - p["overhead_ms"]  # the plan's prefill p95
                fitted_p50, fitted_p95 = profile.predict_ttft_ms(tok["prompt"], tok["cached"])
                answers_p95 = float(correction.apply([fitted_p50], [fitted_p95], answers_state)[1][0])
                row = {"i": i, "hog": busy is not None, "prefill_ms": t["prefill_ms"],
                       "corrected_p95": corrected_p95, "answers_p95": answers_p95, "fitted_p95": fitted_p95,
                       "fitted_p50": fitted_p50,
                       "factor": p["correction_factor"], "mult": p["p95_multiplier"],
                       "speed": p.get("machine_speed"), "k": r["chosen_k"]}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        if busy is not None:
            busy.terminate()
            busy.wait(10)
        server.stop()
        services.close()

    def cov(rs: list[dict[str, Any]], key: str) -> float | None:
        rs = [r for r in rs if r["prefill_ms"] is not None]
        return sum(1 for r in rs if r["prefill_ms"] <= r[key]) / len(rs) if rs else None

    after = [r for r in rows if r["hog"]]
    out = {"kind": "hog", "profile": profile.id, "warmup": cov(rows[:args.warmup], "corrected_p95"),
           "after_1_10": {k: cov(after[:10], f"{k}_p95") for k in ("corrected", "answers", "fitted")},
           "after_11_20": {k: cov(after[10:20], f"{k}_p95") for k in ("corrected", "answers", "fitted")},
           "after_1_20": {k: cov(after[:20], f"{k}_p95") for k in ("corrected", "answers", "fitted")},
           "after_21_40": {k: cov(after[20:40], f"{k}_p95") for k in ("corrected", "answers", "fitted")},
           "factor_end": after[-1]["factor"] if after else None, "rows": rows}
    with args.out.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(out) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))
    return 0


def auth(args: argparse.Namespace) -> int:
    import httpx

    from app.auth import create_key

    services, app, questions = _build(auth=True)
    _, key = create_key(services.engine, "copilot", "load benchmark")
    # The same services (models, store) behind a second app with the key check off.
    open_services = copy.copy(services)
    open_services.settings = services.settings.model_copy(update={"auth_enabled": False})
    from app.api.app import create_app

    open_app = create_app(services=open_services)
    keyed, unkeyed = Server(app), Server(open_app)
    times: dict[str, list[float]] = {"with_key": [], "without_key": []}
    rng = random.Random(args.seed)
    with httpx.Client() as client:
        for i in range(args.auth_requests * 2 + 20):
            which = "with_key" if i % 2 == 0 else "without_key"
            url = keyed.url if which == "with_key" else unkeyed.url
            headers = {"Authorization": f"Bearer {key}"} if which == "with_key" else {}
            q = questions[rng.randrange(len(questions))]
            t0 = time.perf_counter()
            r = client.post(f"{url}/v1/retrieve", json={"query": q, "k": 4}, headers=headers)
            ms = (time.perf_counter() - t0) * 1000.0
            assert r.status_code == 200, r.text
            if i >= 20:  # the first ten of each warm the path
                times[which].append(ms)
    keyed.stop()
    unkeyed.stop()
    # The key check alone, in process (what the server records as auth_ms): HMAC + one key row read.
    from app.auth import authenticate

    direct = []
    for _ in range(args.auth_requests):
        t0 = time.perf_counter()
        authenticate(services.engine, key)
        direct.append((time.perf_counter() - t0) * 1000.0)
    out = {"kind": "auth", "requests_each": args.auth_requests,
           "check_p50_ms": pct(direct, 0.5), "check_p95_ms": pct(direct, 0.95),
           **{f"{k}_p50_ms": pct(v, 0.5) for k, v in times.items()},
           **{f"{k}_p95_ms": pct(v, 0.95) for k, v in times.items()}}
    out["p50_difference_ms"] = out["with_key_p50_ms"] - out["without_key_p50_ms"]  # type: ignore[operator]
    with args.out.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(out) + "\n")
    print(json.dumps(out, indent=1))
    services.close()
    return 0


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
    services, app, questions = _build(auth=args.with_key)
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
    header = _header(services, app)
    header.update(kind="batching-run", max_running=configured, auth=args.with_key)
    results: dict[tuple[int, str], dict[str, Any]] = {}
    with out.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(header) + "\n")
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
                        "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95),
                        "tpot_mean": statistics.fmean(tpot) if tpot else None,
                        "tokens_out_mean": statistics.fmean(r["tokens_out"] for r in ok) if ok else None,
                        "k_mean": statistics.fmean(r["k"] for r in ok) if ok else None,
                        "loadavg": os.getloadavg(), "rows": rows}
                results[(clients, arm)] = cell
                fh.write(json.dumps(cell) + "\n")
                fh.flush()
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
    header = _header(services, app)
    header.update(kind="engine-sweep-run", settings=settings, auth=args.with_key)
    cells: list[dict[str, Any]] = []
    with args.out.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(header) + "\n")
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
                    fh.write(json.dumps(cell) + "\n")
                    fh.flush()
                    print(f"round {rnd} {clients} clients {running}x{budget}: {cell['within']}/{len(rows)} "
                          f"within budget ({wall_s:.0f} s)", file=sys.stderr, flush=True)
    engine.max_running, engine.step_token_budget = configured, configured_budget
    server.stop()
    services.close()
    print(engine_sweep_report(cells))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the grid (default), the CPU-hog coverage run (``--hog``), the auth comparison
    (``--auth``) or print the table of a finished run (``--report``); see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=Path("load.jsonl"), help="jsonl, appended to (resumable)")
    ap.add_argument("--per-cell", type=int, default=8, help="answers per cell and arm")
    ap.add_argument("--rates", default="0.3,0.6", help="Poisson arrival rates, requests/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default="on,off", help=f"grid: the arms to run, from {','.join(ARMS)}")
    ap.add_argument("--loads", default="", help="grid: only these loads, comma-separated (e.g. "
                    "closed-2,closed-4); default all")
    ap.add_argument("--budgets", default="", help="grid: only these budgets (ms), comma-separated")
    ap.add_argument("--tokens-only", default="", help="grid: only these new-token counts, comma-separated")
    ap.add_argument("--report", action="store_true", help="print the table of --out and exit")
    ap.add_argument("--grid-warmup", type=int, default=0,
                    help="grid: answers before the first cell (closed loop, 1 client, 3000 ms), so the "
                    "online correction starts from the machine as it is; rows kept as kind warmup")
    ap.add_argument("--hog", action="store_true", help="the CPU-hog coverage run")
    ap.add_argument("--warmup", type=int, default=10, help="--hog: answers before the hog starts")
    ap.add_argument("--after", type=int, default=40, help="--hog: answers after it started")
    ap.add_argument("--budget", type=float, default=3000.0, help="--hog: the TTFT budget, ms")
    ap.add_argument("--auth", action="store_true", help="/v1/retrieve with vs without a key")
    ap.add_argument("--auth-requests", type=int, default=200, help="--auth: requests per side")
    ap.add_argument("--batching", action="store_true", help="batched vs one-at-a-time, same run")
    ap.add_argument("--clients", default="1,2,4,8", help="--batching: closed-loop client counts")
    ap.add_argument("--per-client", type=int, default=3, help="--batching: answers per client")
    ap.add_argument("--tokens", type=int, default=32, help="--batching: max new tokens")
    ap.add_argument("--with-key", action="store_true", help="--batching: auth on, every request keyed")
    ap.add_argument("--engine-sweep", default="", help="--batching: batched arm only, per engine setting "
                    "RxB (max running x step token budget), comma-separated, e.g. 4x256,8x256,16x256")
    ap.add_argument("--rounds", type=int, default=1, help="--engine-sweep: interleaved rounds")
    args = ap.parse_args(argv)
    args.arm_list = [a for a in args.arms.split(",") if a]
    if not args.arm_list or any(a not in ARMS for a in args.arm_list):
        ap.error(f"--arms: a comma-separated subset of {','.join(ARMS)}, got {args.arms!r}")
    if args.report:
        print(report(args.out))
        return 0
    if args.hog:
        return hog(args)
    if args.auth:
        return auth(args)
    if args.batching:
        return batching(args)
    return grid(args)


if __name__ == "__main__":
    sys.exit(main())
