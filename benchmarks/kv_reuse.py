"""Exact KV reuse beyond the scaffold: a scaffold-only prefix cache vs the block cache, same run.

One process loads the services once (the configured data directory: the real corpus and its
fitted profile) and serves the real app over loopback HTTP (``benchmarks/load_http.py``).
Closed-loop clients (``--clients``, default 1, 2 and 4) send ``POST /v1/chat/completions``
(greedy, ``--tokens`` new tokens, ``on_budget_miss: answer``) from a seeded workload
(:func:`workload`): topics are questions from the corpus's own back-of-book index
(``app.sweep.bookindex_questions``), each new conversation's topic drawn from a Zipf law
(``s = 1.1``) over ``--topics`` of them, and ``--follow-share`` (30 %) of the turns are
follow-ups: the client's conversation so far (its questions and the answers it got) as chat
history, then a follow-up question on the same topic.

Arms, run one after the other on each cell with the same workload (the arm that goes first
alternates from cell to cell): ``A`` the engine's prefix cache limited to the scaffold
(``BlockPrefixCache.scope = "scaffold"``: only the scaffold block is stored and loaded, the
cache as it was before blocks past the scaffold were kept) and follow-ups laid out as text
turns (``follow_up_layout = "text"``); ``B`` the block cache (scope ``all``: scaffold,
retrieved chunks, earlier turns) and follow-ups that continue their earlier turn's exact ids
(``follow_up_layout = "earlier_turn"``, :mod:`app.answering.followup`). Both arms use the one
cache object: under arm A it neither loads nor stores a block past the scaffold, so arm B's
blocks wait untouched. ``--cache-mib`` sets the cache's budget for the run (the setting
``RAGBUDGET_GENERATOR_PREFIX_CACHE_MIB``, set before the services load); each answer's row
records the cache's bytes after it, and the run's end the most it ever held.

Modes (a cell is clients x mode): ``fixed-k`` (every answer at ``--fixed-k`` chunks, the
pipeline's ``fixed_k``, budget 60 s) and ``budget-B`` for each of ``--budgets`` (the planner
chooses k for a TTFT budget of B ms).

Reported per cell: at fixed k the median TTFT of each arm and B's reduction; at each budget
the mean k of each arm, their ratio and the share of answers within budget; for follow-ups,
the median of TTFT over the predicted prefill of their computed (uncached) tokens alone (the
fitted profile's p50 at ``(m, 0)``); the cache's most bytes held against its budget. Goals
(issue 39): fixed-k median TTFT at least 40 % lower; mean k at least 1.5x with >= 95 % within
budget; a follow-up within 1.2x of the prefill of its new tokens alone.

    cp -a /work/main/ragbudget-data /tmp/kv-data    # never write into the prepared directory
    RAGBUDGET_DATA_DIR=/tmp/kv-data flock /tmp/ragbudget-cpu.lock \\
        python -m benchmarks.kv_reuse --out benchmarks/results/kv-reuse-2.jsonl --per-cell 20 --cache-mib 2048
    python -m benchmarks.kv_reuse --out benchmarks/results/kv-reuse-2.jsonl --report
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import append_jsonl, elapsed_ms
from benchmarks.load_report import read_rows

#: Follow-up questions (each names no topic, as a chat follow-up would).
FOLLOW_UPS = ("What are its limits or caveats?", "Can you give a short example?",
              "How is it configured?", "Which related settings should I know about?")
#: The Zipf exponent of topic popularity (issue 39).
ZIPF_S = 1.1
#: Arms: A scaffold-only cache, B the block cache (scope of ``BlockPrefixCache``).
ARM_SCOPE = {"A": "scaffold", "B": "all"}
#: Each arm's follow-up layout (the pipeline's ``follow_up_layout``): A the history as text
#: turns (the answer path before follow-ups continued their earlier turn), B the earlier turn's
#: exact ids first (``app.answering.followup``).
ARM_FOLLOW_UP = {"A": "text", "B": "earlier_turn"}


@dataclass(frozen=True)
class Turn:
    """One request of the workload: ``topic`` (index into the topic list), ``question`` (the
    text sent as the last user message), ``follow_up`` (True: it continues the client's
    conversation, whose earlier turns go with it as history)."""

    topic: int
    question: str
    follow_up: bool


def zipf_weights(n: int, s: float = ZIPF_S) -> list[float]:
    """``(n,)`` probabilities of ranks ``1..n`` under Zipf's law, ``p(r) = r^-s / H(n, s)``.

    Raises:
        ValueError: ``n < 1`` or ``s < 0``.
    """
    if n < 1 or s < 0:
        raise ValueError(f"need n >= 1 and s >= 0, got n={n}, s={s}")
    raw = [r ** -s for r in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def workload(topics: list[str], n: int, clients: int, seed: int, *, s: float = ZIPF_S,
             follow_share: float = 0.3) -> list[list[Turn]]:
    """``clients`` turn lists of ``n`` turns in all (client ``i`` gets turns ``i, i + clients,
    ...``), seeded: a pure function of its arguments.

    ``round(follow_share * n)`` turns are follow-ups, chosen (seeded) among the turns that have
    an earlier turn of the same client (a client's first turn always opens a conversation);
    fewer only when there are not that many such turns. A new conversation's topic is drawn
    from :func:`zipf_weights` over ``topics`` (rank = position in ``topics``); a follow-up keeps
    its conversation's topic and asks one of :data:`FOLLOW_UPS`.

    Raises:
        ValueError: no topics, ``n < 0``, ``clients < 1`` or ``follow_share`` outside ``[0, 1]``.
    """
    if not topics or n < 0 or clients < 1 or not 0.0 <= follow_share <= 1.0:
        raise ValueError("need topics, n >= 0, clients >= 1 and 0 <= follow_share <= 1")
    rng = random.Random(f"kv-reuse-{seed}-{n}-{clients}")
    weights = zipf_weights(len(topics), s)
    eligible = [i for i in range(n) if i >= clients]  # turn i's client had turn i - clients
    follow = set(rng.sample(eligible, min(round(follow_share * n), len(eligible))))
    out: list[list[Turn]] = [[] for _ in range(clients)]
    for i in range(n):
        lane = out[i % clients]
        if i in follow:
            lane.append(Turn(lane[-1].topic, rng.choice(FOLLOW_UPS), True))
        else:
            t = rng.choices(range(len(topics)), weights)[0]
            lane.append(Turn(t, topics[t], False))
    return out


# --- the run ------------------------------------------------------------------------------------

def _post(client: Any, url: str, messages: list[dict[str, str]], budget: float,
          tokens: int) -> dict[str, Any]:
    """One chat completion; the row of its numbers (ms, tokens) or of its error."""
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/chat/completions", timeout=600,
                    json={"messages": messages, "max_tokens": tokens, "temperature": 0,
                          "ttft_budget_ms": budget, "on_budget_miss": "answer"})
    row: dict[str, Any] = {"status": r.status_code, "client_ms": elapsed_ms(t0)}
    if r.status_code != 200:
        row["error"] = r.text[:300]
        return row
    body = r.json()
    extra, usage = body["ragbudget"], body["usage"]
    t = extra["timings"]
    row.update(text=body["choices"][0]["message"]["content"], k=extra["chosen_k"],
               ttft_ms=t["ttft_ms"], prefill_ms=t["prefill_ms"], queue_ms=t["queue_ms"],
               prompt_tokens=usage["prompt_tokens"],
               cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
               predicted_p95_ms=extra["predicted"]["ttft_p95_ms"], binding=extra["binding"],
               receipt_id=extra.get("receipt_id"))
    row["within"] = row["ttft_ms"] is not None and row["ttft_ms"] <= budget
    return row


def run_cell(url: str, lanes: list[list[Turn]], budget: float, tokens: int,
             on_answer: Any) -> list[dict[str, Any]]:
    """Each lane on its own client thread, closed loop; a follow-up carries its lane's
    conversation (questions and answers since its topic's first turn). Rows in completion order."""
    import httpx

    rows: list[dict[str, Any]] = []
    lock = threading.Lock()

    def lane_worker(c: int, turns: list[Turn]) -> None:
        history: list[dict[str, str]] = []
        with httpx.Client() as client:
            for j, turn in enumerate(turns):
                if not turn.follow_up:
                    history = []
                messages = [*history, {"role": "user", "content": turn.question}]
                row = _post(client, url, messages, budget, tokens)
                row.update(client=c, turn=j, topic=turn.topic, follow_up=turn.follow_up,
                           history_messages=len(history))
                on_answer(row)
                with lock:
                    rows.append(row)
                if row["status"] == 200:
                    history = [*messages, {"role": "assistant", "content": row.pop("text")}]

    threads = [threading.Thread(target=lane_worker, args=(c, t)) for c, t in enumerate(lanes)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return rows


def run(args: argparse.Namespace) -> int:
    """The benchmark (module docstring): every cell x arm, rows appended to ``args.out``."""
    import os

    from app.sweep import bookindex_questions
    from benchmarks.load_http import Server, build, run_header

    if args.cache_mib is not None:  # read when the generator loads, below
        os.environ["RAGBUDGET_GENERATOR_PREFIX_CACHE_MIB"] = str(args.cache_mib)
    from receipts.chain import get_receipt

    services, app, _questions = build()
    pipeline = app.state.pipeline
    gen = services.generator
    cache = gen.prefix_cache
    profile = pipeline.profile()
    corpora = sorted((services.data_dir / "corpora").glob("postgres-docs-*"))
    topics = [q["question"] for q in bookindex_questions(corpora[-1], args.topics, args.seed)]
    server = Server(app)
    header = {**run_header(services, app), "kind": "kv-run", "topics": topics, "zipf_s": ZIPF_S,
              "follow_share": args.follow_share, "fixed_k": args.fixed_k, "tokens": args.tokens,
              "prefix_cache_budget_bytes": cache.budget_bytes, "prefill_chunk": gen.prefill_chunk}
    append_jsonl(args.out, [header])
    peak = {"bytes": 0}

    def on_answer(row: dict[str, Any]) -> None:
        held = cache.stats()
        peak["bytes"] = max(peak["bytes"], held.bytes, held.peak_bytes)
        row["cache_bytes"] = held.bytes
        if row.get("receipt_id"):  # how the follow-up was laid out (app.answering.followup)
            conv = (get_receipt(services.engine, row["receipt_id"]).get("prompt") or {}).get("conversation")
            row["conversation"] = conv
        if row.get("prompt_tokens") is not None:
            m = int(row["prompt_tokens"]) - int(row["cached_tokens"])
            row["predicted_new_only_ms"] = profile.predict_ttft_ms(m, 0)[0]

    modes = [("fixed-k", 60_000.0)] + [(f"budget-{b:g}", float(b)) for b in args.budget_list]
    for arm in ("A", "B"):  # warm-up: the scaffold cached and the machine's speed read, per arm
        cache.scope, pipeline.follow_up_layout = ARM_SCOPE[arm], ARM_FOLLOW_UP[arm]
        run_cell(server.url, [[Turn(0, "What is a tablespace?", False)]], 60_000.0, args.tokens, on_answer)
    cell_no = 0
    for clients in args.client_list:
        for mode, budget in modes:
            lanes = workload(topics, args.per_cell, clients, args.seed + cell_no,
                             follow_share=args.follow_share)
            order = ("A", "B") if cell_no % 2 == 0 else ("B", "A")
            cell_no += 1
            for arm in order:
                cache.scope, pipeline.follow_up_layout = ARM_SCOPE[arm], ARM_FOLLOW_UP[arm]
                pipeline.fixed_k = args.fixed_k if mode == "fixed-k" else None
                t0 = time.perf_counter()
                rows = run_cell(server.url, lanes, budget, args.tokens, on_answer)
                for r in rows:
                    r.update(kind="answer", arm=arm, clients=clients, mode=mode, budget=budget)
                append_jsonl(args.out, rows)
                ok = [r for r in rows if r["status"] == 200]
                print(f"{clients} clients {mode:>12} arm {arm}: {len(ok)}/{len(rows)} answered, median TTFT "
                      f"{statistics.median(r['ttft_ms'] for r in ok) if ok else float('nan'):.0f} ms, mean k "
                      f"{statistics.fmean(r['k'] for r in ok) if ok else float('nan'):.2f} "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    pipeline.fixed_k = None
    cache.scope, pipeline.follow_up_layout = "all", "earlier_turn"
    stats = cache.stats()
    append_jsonl(args.out, [{"kind": "kv-end", "peak_bytes": max(peak["bytes"], stats.peak_bytes),
                             "budget_bytes": stats.budget_bytes, "evicted": stats.evicted,
                             "stored": stats.stored, "refused": stats.refused, "pins": stats.pins,
                             "pin_shortened": stats.pin_shortened}])
    server.stop()
    services.close()
    print(report(read_rows(args.out)))
    return 0


# --- the table ----------------------------------------------------------------------------------

def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def report(rows: list[dict[str, Any]]) -> str:
    """Markdown tables of a run's rows (the last ``kv-run`` in them): per clients x mode, the
    arms' median TTFT (fixed k) or mean k and share within budget (budgets); follow-ups'
    TTFT over the predicted prefill of their computed tokens alone; the cache's bytes."""
    runs = [i for i, r in enumerate(rows) if r.get("kind") == "kv-run"]
    rows = rows[runs[-1]:] if runs else rows
    answers = [r for r in rows if r.get("kind") == "answer" and r.get("status") == 200]
    cells: dict[tuple[int, str], dict[str, list[dict[str, Any]]]] = {}
    for r in answers:
        cells.setdefault((r["clients"], r["mode"]), {}).setdefault(r["arm"], []).append(r)
    out = ["| clients | mode | answers A/B | median TTFT A / B (ms) | B vs A (TTFT) | mean k A / B | k ratio "
           "| within budget A / B | cached tokens (median) A / B |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (clients, mode), arms in sorted(cells.items()):
        a, b = arms.get("A", []), arms.get("B", [])
        ta, tb = _med([r["ttft_ms"] for r in a]), _med([r["ttft_ms"] for r in b])
        ka = statistics.fmean(r["k"] for r in a) if a else None
        kb = statistics.fmean(r["k"] for r in b) if b else None
        wa = sum(r["within"] for r in a) / len(a) if a else None
        wb = sum(r["within"] for r in b) / len(b) if b else None
        red = f"{(tb / ta - 1) * 100:+.0f} %" if ta and tb is not None else "-"
        ratio = f"{kb / ka:.2f}x" if ka and kb is not None else "-"
        within = "-" if mode == "fixed-k" else f"{_fmt(wa and wa * 100)} % / {_fmt(wb and wb * 100)} %"
        ca, cb = _med([r["cached_tokens"] for r in a]), _med([r["cached_tokens"] for r in b])
        out.append(f"| {clients} | {mode} | {len(a)}/{len(b)} | {_fmt(ta)} / {_fmt(tb)} | {red} | "
                   f"{_fmt(ka, '.2f')} / {_fmt(kb, '.2f')} | {ratio} | {within} | {_fmt(ca)} / {_fmt(cb)} |")
    out += ["", "| arm | follow-ups | laid out as the earlier turn | median prompt / cached tokens "
            "| median TTFT (ms) | median predicted prefill of computed tokens alone (ms) | median ratio "
            "| within 1.2x |", "|---|---|---|---|---|---|---|---|"]
    for arm in ("A", "B"):
        fu = [r for r in answers if r["arm"] == arm and r["follow_up"] and r.get("predicted_new_only_ms")]
        ratios = [r["ttft_ms"] / r["predicted_new_only_ms"] for r in fu]
        share = sum(x <= 1.2 for x in ratios) / len(ratios) if ratios else None
        layouts = [(r.get("conversation") or {}).get("layout") for r in fu]
        fallbacks = sorted({str(f) for r in fu if (f := (r.get("conversation") or {}).get("fallback"))})
        out.append(f"| {arm} | {len(fu)} | {sum(x == 'earlier_turn' for x in layouts)}"
                   f"{' (text: ' + ', '.join(fallbacks) + ')' if fallbacks else ''} | "
                   f"{_fmt(_med([r.get('prompt_tokens', 0) for r in fu]))} / "
                   f"{_fmt(_med([r.get('cached_tokens', 0) for r in fu]))} | "
                   f"{_fmt(_med([r['ttft_ms'] for r in fu]))} | "
                   f"{_fmt(_med([r['predicted_new_only_ms'] for r in fu]))} | {_fmt(_med(ratios), '.2f')} | "
                   f"{_fmt(share and share * 100)} % |")
    end = next((r for r in reversed(rows) if r.get("kind") == "kv-end"), None)
    held = max([r.get("cache_bytes", 0) for r in rows if r.get("kind") == "answer"], default=0)
    if end is not None:
        out += ["", f"Prefix cache: most bytes held {max(end['peak_bytes'], held) / 2**20:.1f} MiB of a "
                f"{end['budget_bytes'] / 2**20:.0f} MiB budget; blocks stored {end['stored']}, evicted "
                f"{end['evicted']}, not kept {end['refused']}; pins left {end['pins']}, pins shortened "
                f"{end['pin_shortened']}."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, or print the tables of a finished run (``--report``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=Path("kv-reuse.jsonl"), help="jsonl, appended to")
    ap.add_argument("--clients", default="1,2,4", help="closed-loop client counts")
    ap.add_argument("--per-cell", type=int, default=12, help="answers per cell and arm")
    ap.add_argument("--budgets", default="1200,3000", help="TTFT budgets, ms")
    ap.add_argument("--fixed-k", type=int, default=4, help="k of the fixed-k mode")
    ap.add_argument("--topics", type=int, default=30, help="book-index questions drawn as topics")
    ap.add_argument("--follow-share", type=float, default=0.3, help="share of follow-up turns")
    ap.add_argument("--tokens", type=int, default=8, help="new tokens per answer")
    ap.add_argument("--cache-mib", type=int, default=None,
                    help="the prefix cache's budget for this run, MiB (default: the setting)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", action="store_true", help="print the tables of --out and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(report(read_rows(args.out)))
        return 0
    args.client_list = [int(c) for c in args.clients.split(",") if c]
    args.budget_list = [float(b) for b in args.budgets.split(",") if b]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
