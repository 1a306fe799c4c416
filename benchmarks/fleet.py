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

The baselines run once per fixed k of ``--baseline-k`` (a sweep, e.g. ``0,1,2,3``: an operator
choosing the best static setting), or, without it, at the k the planner gives the first question
on an idle engine, at least 1. :func:`compare` then puts beside the joint choice, per budget and
baseline, the largest fixed k at which the baseline kept at least ``ADHERENCE`` of its answers
within the budget (the fair comparison: a higher mean k at equal or better adherence). The joint
arm asks to be refused fast (``on_budget_miss: reject``, 503 with Retry-After) when no engine can
make k = 0; the baselines cannot refuse, so the joint arm's adherence is also given over every
request, a refusal counted as a miss. With ``--flood ENGINE`` another client sends long
completions straight to that engine (not through ragbudget) during every arm; with
``--flood-phase ENGINE`` the arms run first without it and then again with it (phase ``flood``),
each baseline at its largest adherent k of the first phase.

With ``--kill ENGINE``, after the arms (same servers, same fitted profiles), the kill phase
(:mod:`benchmarks.fleet_kill`) runs the joint choice at the largest budget while that engine's
server is killed (SIGKILL) and restarted, then ``ragbudget receipts verify``.

Per arm, fixed k and budget: share of answered requests within the budget, share refused fast,
mean k, goodput (answers within budget per minute), TTFT p50/p95, each engine's share of the
answers, and how the plan's predictions held (share of answers at or under their predicted p95
TTFT, median measured/predicted p50, the bindings that stopped k).

    RAGBUDGET_DATA_DIR=bench-data python -m benchmarks.fleet --clients 4 --rounds 4 \\
        --budgets 1500 3000 --baseline-k 0,1,2,3 --kill a --json benchmarks/results/fleet-2.json
    RAGBUDGET_DATA_DIR=bench-data python -m benchmarks.fleet --arms --kill a --clients 3 \\
        --budgets 3000 --max-new-tokens 8          # the kill phase alone
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import machine_line, quantile_or_none

ARMS = ("rr", "least", "joint")
BASELINES = ("rr", "least")
ALIAS = "smollm2-135m-instruct-q4_1"

#: The share of answers within budget an arm must keep to count as adherent: the issue's goal
#: for the joint choice (>= 95 %), applied to the baselines' fixed k alike.
ADHERENCE = 0.95


def _flood(url: str, stop: threading.Event) -> list[threading.Thread]:
    """Two client threads sending long completions straight to ``url`` until ``stop``."""
    from ragbudget_testing.llama_server import flood

    return flood(url, stop, model=ALIAS, max_tokens=256)


def parse_ks(text: str) -> list[int]:
    """``"0,1,3"`` -> ``[0, 1, 3]`` (sorted, unique).

    Raises:
        argparse.ArgumentTypeError: an entry that is not an integer >= 0, or none at all.
    """
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from exc
    if not ks or ks[0] < 0:
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return ks


def answer_row(a: Any) -> dict[str, Any]:
    """The measured and predicted fields of one answered request (an ``app.answering.types.Answer``):
    status, TTFT and its parts (ms), k, engine, within budget, the plan's binding and its
    predicted TTFT p50/p95 for the chosen k (the same quantity as ``ttft_ms``), the wait it
    priced on arrival and the correction in force."""
    t, p = a.timings, a.predicted
    return {"status": a.status, "ttft_ms": t.ttft_ms, "k": a.chosen_k, "engine": p.engine_id,
            "within": a.within_budget, "binding": a.binding, "pred_p50_ms": p.ttft_p50_ms,
            "pred_p95_ms": p.ttft_p95_ms, "pred_wait_ms": p.wait_ms, "plan_overhead_ms": p.overhead_ms,
            "queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms, "overhead_ms": t.overhead_ms,
            "computed_tokens": a.tokens.computed, "correction_factor": p.correction_factor,
            "p95_multiplier": p.p95_multiplier, "miss_cause": a.budget_miss_cause}


def run_arm(pipe: Any, arm: str, fixed_k: int | None, questions: list[str], budget: float,
            clients: int, rounds: int, max_new_tokens: int, phase: str = "arms",
            offset: int = 0) -> list[dict[str, Any]]:
    """``clients`` closed-loop clients each ask ``rounds`` questions at ``budget`` in ``arm``
    (``fixed_k`` for a baseline, None for the joint choice), the cell's ``clients * rounds``
    questions taken from ``questions`` from ``offset`` on (so cells do not repeat each other's
    prompts, which an engine's prompt cache would serve); one row per request, each with the
    cell's wall time in minutes (``run_minutes``)."""
    from app.answering.state import AnswerRequest
    from foundation.errors import RagBudgetError

    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    pipe.routing = {"rr": "round_robin", "least": "least_ttft", "joint": "joint"}[arm]
    pipe.fixed_k = None if arm == "joint" else fixed_k
    cell = {"phase": phase, "arm": arm, "fixed_k": pipe.fixed_k, "budget_ms": budget}

    def client(c: int) -> None:
        for r in range(rounds):
            q = questions[(offset + c * rounds + r) % len(questions)]
            t0 = time.perf_counter()
            try:
                a = pipe.answer(AnswerRequest(q, ttft_budget_ms=budget, max_new_tokens=max_new_tokens,
                                              on_budget_miss="reject" if arm == "joint" else "answer"))
                row = {**cell, **answer_row(a)}
            except RagBudgetError as exc:
                row = {**cell, "status": exc.code, "ttft_ms": None, "k": None, "engine": None,
                       "within": False}
            row["wall_ms"] = (time.perf_counter() - t0) * 1000.0
            with lock:
                rows.append(row)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    minutes = (time.perf_counter() - t0) / 60.0
    for row in rows:
        row["run_minutes"] = minutes
    pipe.fixed_k = None
    return rows


def cell_name(phase: str, arm: str, fixed_k: int | None, budget: float) -> str:
    """The summary key of one cell: ``arm[@kK]@budget``, prefixed ``flood/`` in the flood phase."""
    return (f"{phase}/" if phase != "arms" else "") + arm + ("" if fixed_k is None else f"@k{fixed_k}") \
        + f"@{budget:.0f}"


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase, arm, fixed k and budget (:func:`cell_name`): requests, answers, within budget
    (share of the answers, and of every request with a refusal counted as a miss), refused fast,
    mean k, goodput (answers within budget per minute of the cell's wall time), TTFT p50/p95,
    engine shares, statuses, and the predictions: ``pred_p95_cover`` (share of answers whose
    measured TTFT was at or under the plan's p95), ``ttft_over_pred_p50`` (median measured over
    predicted p50), ``pred_wait_ms_median`` and the bindings. Rows of the kill phase are left out."""
    out: dict[str, Any] = {}
    cells: dict[tuple[str, str, int | None, float], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("arm") in ARMS:
            key = (r.get("phase", "arms"), r["arm"], r.get("fixed_k"), r["budget_ms"])
            cells.setdefault(key, []).append(r)
    for (phase, arm, fixed_k, budget), sel in cells.items():
        answered = [r for r in sel if r["engine"]]
        ttfts = [r["ttft_ms"] for r in answered if r["ttft_ms"] is not None]
        ks = [r["k"] for r in answered if r["k"] is not None]
        within = sum(1 for r in answered if r["within"])
        engines = Counter(r["engine"] for r in answered)
        predicted = [r for r in answered if r.get("pred_p95_ms") is not None and r["ttft_ms"] is not None]
        ratios = [r["ttft_ms"] / r["pred_p50_ms"] for r in predicted if r.get("pred_p50_ms")]
        waits = [r["pred_wait_ms"] for r in answered if r.get("pred_wait_ms") is not None]
        out[cell_name(phase, arm, fixed_k, budget)] = {
            "phase": phase, "arm": arm, "fixed_k": fixed_k, "budget_ms": budget,
            "requests": len(sel), "answers": len(answered),
            "within_budget": within / len(answered) if answered else None,
            "within_budget_of_requests": within / len(sel),
            "refused_fast": sum(1 for r in sel if r["status"] == "budget_unreachable") / len(sel),
            "mean_k": sum(ks) / len(ks) if ks else None,
            "goodput_per_min": within / sel[0]["run_minutes"],
            "ttft_p50_ms": quantile_or_none(ttfts, 0.5), "ttft_p95_ms": quantile_or_none(ttfts, 0.95),
            "engine_share": {e: n / len(answered) for e, n in sorted(engines.items())},
            "statuses": dict(Counter(r["status"] for r in sel)),
            "pred_p95_cover": (sum(1 for r in predicted if r["ttft_ms"] <= r["pred_p95_ms"]) / len(predicted)
                               if predicted else None),
            "ttft_over_pred_p50": statistics.median(ratios) if ratios else None,
            "pred_wait_ms_median": statistics.median(waits) if waits else None,
            "bindings": dict(Counter(r.get("binding") for r in answered))}
    return out


def compare(summary: dict[str, Any], phase: str = "arms") -> dict[str, Any]:
    """Per budget of ``phase``: the joint choice's adherence (of its answers and of every request),
    refusals and mean k beside, for each baseline, the largest fixed k whose cell kept at least
    :data:`ADHERENCE` of its answers within budget (None: no k of the sweep did) with that cell's
    adherence and goodput. ``goal_met``: the joint choice kept :data:`ADHERENCE` of its answers
    and its mean k is above every baseline's adherent k (a baseline with none is beaten on
    adherence). ``goal_met_counting_refusals`` asks the same with the joint choice's refusals
    counted as misses.
    """
    out: dict[str, Any] = {}
    budgets = sorted({c["budget_ms"] for c in summary.values() if c["phase"] == phase})
    for budget in budgets:
        cells = [c for c in summary.values() if c["phase"] == phase and c["budget_ms"] == budget]
        joint = next((c for c in cells if c["arm"] == "joint"), None)
        entry: dict[str, Any] = {"joint": None if joint is None else {
            key: joint[key] for key in ("within_budget", "within_budget_of_requests", "refused_fast",
                                        "mean_k", "goodput_per_min", "ttft_p95_ms")}}
        for base in BASELINES:
            ok = [c for c in cells if c["arm"] == base and c["fixed_k"] is not None
                  and (c["within_budget"] or 0.0) >= ADHERENCE]
            best = max(ok, key=lambda c: c["fixed_k"]) if ok else None
            swept = sorted(c["fixed_k"] for c in cells if c["arm"] == base and c["fixed_k"] is not None)
            entry[base] = {"swept_k": swept, "adherent_k": None if best is None else best["fixed_k"],
                           "within_budget": None if best is None else best["within_budget"],
                           "goodput_per_min": None if best is None else best["goodput_per_min"]}
        if joint is not None and joint["mean_k"] is not None:
            for key, share in (("goal_met", joint["within_budget"]),
                               ("goal_met_counting_refusals", joint["within_budget_of_requests"])):
                entry[key] = bool((share or 0.0) >= ADHERENCE and all(
                    entry[b]["adherent_k"] is None or joint["mean_k"] > entry[b]["adherent_k"]
                    for b in BASELINES if entry[b]["swept_k"]))
        out[f"{budget:.0f}"] = entry
    return out


def run_phase(pipe: Any, phase: str, ks: dict[str, dict[float, list[int]]], arms: list[str],
              questions: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every arm of ``arms`` at every budget of ``args.budgets``, budget by budget; each baseline
    once per fixed k of ``ks[arm][budget]``. One row per request (:func:`run_arm`)."""
    rows: list[dict[str, Any]] = []
    offset = 0
    for budget in args.budgets:
        for arm in arms:
            for k in ([None] if arm == "joint" else ks[arm][budget]):
                rows += run_arm(pipe, arm, k, questions, budget, args.clients, args.rounds,
                                args.max_new_tokens, phase, offset)
                offset += args.clients * args.rounds
                print(f"  {cell_name(phase, arm, k, budget)} done", flush=True)
    return rows


def print_report(result: dict[str, Any], kill_engine: str | None) -> None:
    """The run's tables on stdout: every cell, the comparison at equal adherence, the kill phase."""
    print(result["machine"])
    print(f"{'cell':<22} {'n':>3} {'within':>7} {'refused':>7} {'mean k':>7} {'goodput/min':>11} "
          f"{'p50 ms':>8} {'p95 ms':>8} {'<=p95':>6} {'x p50':>6}  engines")
    nan = float("nan")
    for name, s in result["summary"].items():
        print(f"{name:<22} {s['requests']:>3} {s['within_budget'] or 0.0:>7.0%} {s['refused_fast']:>7.0%} "
              f"{s['mean_k'] if s['mean_k'] is not None else nan:>7.2f} {s['goodput_per_min']:>11.1f} "
              f"{s['ttft_p50_ms'] or nan:>8.0f} {s['ttft_p95_ms'] or nan:>8.0f} "
              f"{s['pred_p95_cover'] if s['pred_p95_cover'] is not None else nan:>6.0%} "
              f"{s['ttft_over_pred_p50'] or nan:>6.2f}  {s['engine_share']} {s['bindings']}")
    for phase, comparison in result["compare"].items():
        print(f"at equal adherence (>= {ADHERENCE:.0%} within budget), phase {phase}:")
        for budget, entry in comparison.items():
            print(f"  {budget} ms: {json.dumps(entry)}")
    kill = result.get("kill")
    if kill is not None:
        ev = kill["events_s"]
        print(f"kill phase (engine {kill_engine} killed at {ev.get('killed_s')} s, restarted at "
              f"{ev.get('restarted_s')} s, back in rotation at {ev.get('rejoined_s')} s):")
        for key, value in kill.items():
            if key != "events_s":
                print(f"  {key:<26} {value}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the tables (and write ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budgets", type=float, nargs="+", default=[1500.0, 3000.0])
    ap.add_argument("--baseline-k", type=parse_ks, default=None,
                    help="the fixed k the baselines sweep, e.g. 0,1,2,3 (default: the planner's k "
                         "for the first question on an idle engine, at least 1)")
    ap.add_argument("--questions", type=int, default=300,
                    help="questions drawn from the book index besides the operational ones")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--flood", default=None, help="engine id another client floods during every arm")
    ap.add_argument("--flood-phase", default=None,
                    help="engine id flooded in a second phase of the arms (baselines at their adherent k)")
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS,
                    help="the routing arms to run (none: only the kill phase)")
    ap.add_argument("--kill", default=None, help="engine id killed and restarted in the kill phase")
    ap.add_argument("--kill-after-s", type=float, default=10.0)
    ap.add_argument("--down-s", type=float, default=10.0)
    ap.add_argument("--after-s", type=float, default=10.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from app.answering.pipeline import AnswerPipeline
    from app.answering.state import AnswerRequest
    from app.profile_store import save_profile
    from app.services import Services
    from app.settings import get_settings
    from app.sweep import default_questions
    from benchmarks.fleet_kill import receipts_verify, run_kill_arm, summarise_kill
    from generation.assets import ensure_packaged_generator, packaged_gguf_path
    from latency_model.calibration import calibrate
    from latency_model.grid import quick_grid
    from ragbudget_testing.llama_server import NativeLlamaServer

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_before = os.getloadavg()
    smollm = ensure_packaged_generator(get_settings().data_dir)
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
        profiles = {}
        for eid in ids:
            prof = calibrate(services.engine_generator(eid), grid=grid, seed=0, progress=False)
            save_profile(services.engine, services.data_dir, prof)
            profiles[eid] = prof.id
        pipe = AnswerPipeline(services)
        pipe.warm()
        questions = [q["question"] for q in default_questions(services.data_dir, args.questions, 0)]
        planned = {b: max(int(pipe.prepare(AnswerRequest(questions[0], ttft_budget_ms=b)).plan.chosen_k
                                  or 0), 1) for b in args.budgets}
        ks = {arm: {b: args.baseline_k or [planned[b]] for b in args.budgets} for arm in BASELINES}
        stop = threading.Event()
        flood = _flood(servers[args.flood].base_url, stop) if args.flood else []
        rows: list[dict[str, Any]] = []
        comparisons: dict[str, Any] = {}
        kill: dict[str, Any] | None = None
        try:
            rows += run_phase(pipe, "arms", ks, args.arms, questions, args)
            comparisons["arms"] = compare(summarise(rows), "arms")
            if args.flood_phase and args.arms:
                # each baseline at the largest k that kept ADHERENCE unflooded (else its least k)
                ks_flood = {arm: {b: [comparisons["arms"][f"{b:.0f}"][arm]["adherent_k"]
                                      if comparisons["arms"][f"{b:.0f}"][arm]["adherent_k"] is not None
                                      else ks[arm][b][0]] for b in args.budgets} for arm in BASELINES}
                stop_b = threading.Event()
                flood_b = _flood(servers[args.flood_phase].base_url, stop_b)
                try:
                    rows += run_phase(pipe, "flood", ks_flood, args.arms, questions, args)
                finally:
                    stop_b.set()
                    for t in flood_b:
                        t.join(600)
                comparisons["flood"] = compare(summarise(rows), "flood")
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
        result = {"machine": machine_line(), "started_utc": started,
                  "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                  "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
                  "engines": len(ids), "pinned": "one core each (taskset)", "profiles": profiles,
                  "clients": args.clients, "rounds": args.rounds, "budgets": args.budgets,
                  "max_new_tokens": args.max_new_tokens,
                  "baseline_k": {arm: {str(b): v for b, v in per.items()} for arm, per in ks.items()},
                  "flood": args.flood, "flood_phase": args.flood_phase,
                  "residual_band": bool(pipe.switches.residual_band), "summary": summarise(rows),
                  "compare": comparisons, "kill": kill, "rows": rows}
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
        print_report(result, args.kill)
        pipe.close()
        services.close()
    finally:
        for s in servers.values():
            s.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
