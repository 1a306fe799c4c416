"""The TTFT budget under concurrent load: late binding + online correction on vs off, same run.

One process loads the services once (the configured data directory: the real
corpus and its fitted profile) and serves the real app over HTTP with uvicorn
on a loopback port; client threads post ``POST /v1/answer`` with
``on_budget_miss: reject``. Cells: load (closed loop with 1, 2 and 4 clients,
each client asking again as soon as it has its answer, or, refused fast, once the refusal's
``Retry-After`` has passed (``--retry-immediately``: at once); open loop with Poisson
arrivals at two rates) x budget (800, 1500, 3000 ms) x new tokens (32, 64) x arm
(``on``: late binding and online correction following the machine speed read from the
engine's steps, and room left for requests that arrived meanwhile; ``on-answers``: the same,
the correction learned from answers alone, live speed off; ``on-greedy``: ``on`` but each answer
binds as if no one came after it (``room_for_arrivals`` off); ``on-floor``: ``on`` with the
online correction's earlier p95 rule (the fitted spread as a floor, ``residual_band`` off:
:mod:`latency_model.correction`); ``off``: late binding and
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
answers 1, 2-5, 6-10, 1-10, 11-20, 1-20 and 21-40 after the hog started.

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
        python -m benchmarks.load --out benchmarks/results/load-grid-N.jsonl --per-cell 20
    python -m benchmarks.load --out benchmarks/results/load-grid-16.jsonl --report   # the markdown table
    python -m benchmarks.load --out FILE --report --batching   # a --batching run's table
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from benchmarks.common import append_jsonl
from benchmarks.load_http import Server, build, run_cell, run_header, set_arm
from benchmarks.load_report import ARMS, read_rows, report, summarise

BUDGETS = (800.0, 1500.0, 3000.0)
TOKENS = (32, 64)


def _loads(rates: list[float]) -> list[str]:
    """The grid's loads: closed loop at 1, 2 and 4 clients, then Poisson at each rate (1/s)."""
    return ["closed-1", "closed-2", "closed-4"] + [f"poisson-{r:g}" for r in rates]


def grid(args: argparse.Namespace) -> int:
    """The grid (the default run; see the module docstring): every selected cell x arm,
    ``args.per_cell`` requests each, one jsonl row per answer appended to ``args.out`` (cells
    already complete there are skipped); prints the markdown table at the end; returns 0."""
    services, app, questions = build()
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
    # ``--budgets`` replaces the default budgets (any positive ms, e.g. the 1200 and 2500 of the
    # precision goals), in the order given.
    budgets = ([float(x) for x in args.budgets.split(",") if x] if args.budgets
               else sorted(BUDGETS, key=lambda b: (b != 1500.0, b)))
    cells = [(load, b, t) for t in TOKENS for b in budgets for load in _loads(rates)
             if (not args.loads or load in args.loads.split(","))
             and (not args.tokens_only or t in [int(x) for x in args.tokens_only.split(",")])]
    if any(b <= 0 for b in budgets):
        raise SystemExit(f"--budgets: positive milliseconds, got {args.budgets!r}")
    if not cells:
        raise SystemExit(f"no grid cell matches --loads {args.loads!r} --tokens-only "
                         f"{args.tokens_only!r} (loads: {','.join(_loads(rates))}; tokens: "
                         f"{','.join(str(t) for t in TOKENS)})")
    rng = random.Random(args.seed)
    header = {**run_header(services, app), "retry_immediately": args.retry_immediately}
    append_jsonl(out, [header])
    if args.grid_warmup and not done:
        # A server in service has answered before: feed the online correction the
        # machine as it is now (rows kept as kind "warmup", outside every cell).
        set_arm(pipeline, "on")
        rows = run_cell(server.url, "closed-1", 3000.0, TOKENS[0], args.grid_warmup, questions,
                        random.Random(f"{args.seed}-warmup"), {})
        for r in rows:
            r.update(kind="warmup", arm="on", load="closed-1", budget=3000.0, tokens=TOKENS[0])
        append_jsonl(out, rows)
        state = pipeline.bands.correction_state(pipeline.profile().id)
        print(f"warm-up: {len(rows)} answers, correction factor {state.factor:.3f}, "
              f"p95 multiplier {state.p95_multiplier}", file=sys.stderr, flush=True)
    for load, budget, tokens in cells:
        for arm in arms:
            key = (arm, load, budget, tokens)
            cell_rng = random.Random(f"{args.seed}-{load}-{budget}-{tokens}")  # same questions per arm
            if done.get(key, 0) >= args.per_cell:
                continue
            set_arm(pipeline, arm)
            t0 = time.perf_counter()
            rows = run_cell(server.url, load, budget, tokens, args.per_cell, questions, cell_rng, {},
                            retry_immediately=args.retry_immediately)
            for r in rows:
                r.update(kind="answer", arm=arm, load=load, budget=budget, tokens=tokens)
            append_jsonl(out, rows)
            s = summarise(rows, budget)
            print(f"{load:>12} {budget:5.0f} ms {tokens:3d} tok {arm:>10}: answered {s['answered']}/"
                  f"{s['requests']} within {s['within']} rejected {s['rejected']} used {s['used']} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    del rng
    server.stop()
    services.close()
    print(report(out))
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
    ap.add_argument("--budgets", default="", help="grid: these budgets (ms), comma-separated, "
                    "instead of 800,1500,3000")
    ap.add_argument("--tokens-only", default="", help="grid: only these new-token counts, comma-separated")
    ap.add_argument("--report", action="store_true", help="print the table of --out and exit")
    ap.add_argument("--grid-warmup", type=int, default=0,
                    help="grid: answers before the first cell (closed loop, 1 client, 3000 ms), so the "
                    "online correction starts from the machine as it is; rows kept as kind warmup")
    ap.add_argument("--retry-immediately", action="store_true",
                    help="grid: a closed-loop client refused fast asks again at once instead of "
                    "waiting the refusal's Retry-After (how runs before 2026-12-03 behaved)")
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
        from benchmarks.load_report import batching_report

        rows = read_rows(args.out)
        if args.batching:  # a --batching run's file: its cells' table
            print(batching_report([r for r in rows if r.get("kind") == "batching"]))
        elif any(r.get("kind") == "hog" for r in rows):  # a --hog run's file
            from benchmarks.load_hog import hog_report

            print(hog_report(rows))
        else:
            print(report(args.out))
        return 0
    if args.hog:
        from benchmarks.load_hog import hog

        return hog(args)
    if args.auth:
        from benchmarks.load_auth import auth

        return auth(args)
    if args.batching:
        from benchmarks.load_batching import batching

        return batching(args)
    return grid(args)


if __name__ == "__main__":
    sys.exit(main())
