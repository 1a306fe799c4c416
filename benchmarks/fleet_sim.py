"""Beyond one machine, by simulation: the fleet planner over measured profiles, 4 to 64 engines.

A discrete-event simulation (no model runs; seconds of CPU) of a fleet of engines,
each one slot (one request at a time, FIFO), with Poisson arrivals of RAG requests.
Every engine's prefill and decode costs come from one fitted latency profile (a
``ragbudget`` profile JSON, ``--profile``), scaled per engine by a speed factor
(``--speeds``, cycled over the engines: a mixed fleet). Three routing arms, the same
arrivals and the same noise draws in each:

* ``rr``: round-robin over engines at a fixed k (what a plain load balancer does);
* ``least``: the engine with the least predicted TTFT (its predicted wait plus the
  prefill p95 of the request at the fixed k), llm-d's predicted-latency routing;
* ``joint``: :func:`latency_model.fleet.choose`, engine and k together, refusing fast
  when no engine can make k = 0 within the budget.

The model and its assumptions (docs/benchmarks.md, "Fleet simulation"):

* a request's true prefill is the profile's p50 at its prompt times ``exp(N(0, sigma))``
  (``--noise``, default 0.15, about the spread of served prefills on the 2-core CPU);
  the scaffold is cached on every engine after its first request;
* decode takes ``max_new_tokens`` steps at the profile's TPOT (scaled); the slot is
  busy for prefill + decode;
* an engine's predicted wait is what the planner would know: the predicted remaining
  service (p50) of the request it runs plus that of each request queued there;
* chunk lengths are drawn from ``--chunk-tokens`` (default: 100-260 tokens, about the
  real corpus's chunks), a question is 12-30 tokens;
* the arrival rate is ``--load`` times the fleet's capacity at the fixed k (each
  engine's service rate at its speed, summed).

Per arm: share of answered requests whose TTFT is within the budget, share refused
fast (joint only: a 503 with Retry-After at arrival, no queueing), mean k of answered
requests, goodput (answers within budget per minute), TTFT p50/p95 of answered requests.

    python -m benchmarks.fleet_sim --profile profile.json --engines 4 16 64 --budgets 1500 3000
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from benchmarks.common import machine_line, quantile_or_none
from latency_model.fleet import EngineView, choose
from latency_model.profile import Profile

ARMS = ("rr", "least", "joint")
SCAFFOLD_TOKENS = 83  # the demo scaffold (docs/architecture.md)


@dataclass(frozen=True)
class ScaledBand:
    """A profile's prefill band times ``speed`` (an engine ``speed`` times slower)."""

    profile: Profile
    speed: float

    @property
    def id(self) -> str:
        """The underlying profile's id with the speed factor."""
        return f"{self.profile.id}@x{self.speed:g}"

    @property
    def source(self) -> str:
        """The underlying profile's source."""
        return self.profile.source

    def predict_ttft_many(self, prompt_tokens: ArrayLike, cached_tokens: ArrayLike,
                          prefix_tokens: ArrayLike | None = None
                          ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """``(p50, p95)`` ms of the profile, times ``speed``."""
        p50, p95 = self.profile.predict_ttft_many(prompt_tokens, cached_tokens, prefix_tokens)
        return p50 * self.speed, p95 * self.speed


@dataclass
class Request:
    """One simulated request: arrival (ms), token counts and its noise draw."""

    arrival_ms: float
    question_tokens: int
    chunk_tokens: list[int]
    noise: float
    k: int | None = None
    engine: int | None = None
    ttft_ms: float | None = None


@dataclass
class SimEngine:
    """One engine: its band, TPOT, a FIFO queue and one slot."""

    band: ScaledBand
    tpot_ms: float
    queue: deque[tuple[Request, float]] = field(default_factory=deque)
    busy_until_ms: float = 0.0
    running_predicted_end_ms: float = 0.0
    warm: bool = False

    def predicted_wait_ms(self, now: float) -> float:
        """Predicted remaining service of the running request plus every queued one (p50)."""
        wait = max(0.0, self.running_predicted_end_ms - now) if self.busy_until_ms > now else 0.0
        return wait + sum(pred for _r, pred in self.queue)


def prompt_tokens(req: Request, k: int) -> int:
    """Tokens of the request's prompt with its first ``k`` chunks."""
    return SCAFFOLD_TOKENS + req.question_tokens + sum(req.chunk_tokens[:k])


def simulate(arm: str, engines_n: int, budget_ms: float, args: argparse.Namespace,
             profile: Profile) -> dict[str, Any]:
    """Run one arm; the per-arm summary (see module docstring)."""
    rng = np.random.default_rng(args.seed)
    speeds = [args.speeds[i % len(args.speeds)] for i in range(engines_n)]
    tpot = profile.predict_tpot_ms(SCAFFOLD_TOKENS + 400)
    engines = [SimEngine(ScaledBand(profile, s), tpot * s) for s in speeds]
    # Arrival rate: --load x the fleet's capacity at the fixed k.
    typical = SCAFFOLD_TOKENS + 20 + args.fixed_k * int(np.mean(args.chunk_tokens))
    service_ms = (float(profile.predict_ttft_ms(typical, SCAFFOLD_TOKENS, SCAFFOLD_TOKENS)[0])
                  + args.max_new_tokens * tpot)
    rate_per_ms = args.load * sum(1.0 / (service_ms * s) for s in speeds)
    t = 0.0
    requests = []
    for _ in range(args.requests):
        t += float(rng.exponential(1.0 / rate_per_ms))
        chunks = [int(rng.choice(args.chunk_tokens)) for _ in range(args.candidates)]
        requests.append(Request(t, int(rng.integers(12, 31)), chunks, float(rng.normal(0.0, args.noise))))

    events: list[tuple[float, int, str, int]] = []  # (time ms, seq, kind, engine or request index)
    seq = 0
    for i, r in enumerate(requests):
        heapq.heappush(events, (r.arrival_ms, seq, "arrive", i))
        seq += 1
    rr_next = 0
    refused = 0

    def predicted_service(e: SimEngine, req: Request, k: int) -> float:
        cached = SCAFFOLD_TOKENS if e.warm else 0
        p50 = float(e.band.predict_ttft_many([prompt_tokens(req, k)], [cached], [SCAFFOLD_TOKENS])[0][0])
        return p50 + args.max_new_tokens * e.tpot_ms

    def start(ei: int, now: float) -> None:
        nonlocal seq
        e = engines[ei]
        if e.busy_until_ms > now or not e.queue:
            return
        req, pred = e.queue.popleft()
        assert req.k is not None
        cached = SCAFFOLD_TOKENS if e.warm else 0
        p50 = float(e.band.predict_ttft_many([prompt_tokens(req, req.k)], [cached], [SCAFFOLD_TOKENS])[0][0])
        prefill = p50 * math.exp(req.noise)
        e.warm = True
        req.ttft_ms = now - req.arrival_ms + prefill
        e.busy_until_ms = now + prefill + args.max_new_tokens * e.tpot_ms
        e.running_predicted_end_ms = now + pred
        heapq.heappush(events, (e.busy_until_ms, seq, "done", ei))
        seq += 1

    while events:
        now, _s, kind, idx = heapq.heappop(events)
        if kind == "done":
            start(idx, now)
            continue
        req = requests[idx]
        if arm == "rr":
            ei, k = rr_next % engines_n, args.fixed_k
            rr_next += 1
        elif arm == "least":
            k = args.fixed_k
            scores = []
            for e in engines:
                cached = SCAFFOLD_TOKENS if e.warm else 0
                p95 = float(e.band.predict_ttft_many([prompt_tokens(req, k)], [cached],
                                                     [SCAFFOLD_TOKENS])[1][0])
                scores.append(e.predicted_wait_ms(now) + p95)
            ei = int(np.argmin(scores))
        else:
            views = [EngineView(str(i), e.band, e.predicted_wait_ms(now), context_window=8192,
                                scaffold_cached=e.warm, in_flight=len(e.queue) + (e.busy_until_ms > now))
                     for i, e in enumerate(engines)]
            got = choose(views, question_tokens=req.question_tokens, scaffold_tokens=SCAFFOLD_TOKENS,
                         chunk_tokens=req.chunk_tokens, budget_ms=budget_ms,
                         max_new_tokens=args.max_new_tokens)
            if not got.fits or got.engine_id is None or got.chosen_k is None:
                refused += 1
                continue
            ei, k = int(got.engine_id), got.chosen_k
        req.k, req.engine = k, ei
        e = engines[ei]
        e.queue.append((req, predicted_service(e, req, k)))
        start(ei, now)

    answered = [r for r in requests if r.ttft_ms is not None]
    ttfts = [float(r.ttft_ms) for r in answered if r.ttft_ms is not None]
    within = sum(1 for x in ttfts if x <= budget_ms)
    answered_n = max(1, len(answered))
    span_min = max(r.arrival_ms for r in requests) / 60000.0
    return {"arm": arm, "engines": engines_n, "budget_ms": budget_ms, "requests": len(requests),
            "within_budget": within / answered_n, "refused": refused / len(requests),
            "mean_k": float(np.mean([r.k for r in answered])) if answered else None,
            "goodput_per_min": within / span_min if span_min > 0 else None,
            "ttft_p50_ms": quantile_or_none(ttfts, 0.5), "ttft_p95_ms": quantile_or_none(ttfts, 0.95)}


def main(argv: list[str] | None = None) -> int:
    """Run every (engines, budget, arm) and print one JSON row each, then a table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, required=True,
                    help="a fitted profile JSON (e.g. a file under <data_dir>/profiles/)")
    ap.add_argument("--engines", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--budgets", type=float, nargs="+", default=[1500.0, 3000.0])
    ap.add_argument("--speeds", type=float, nargs="+", default=[1.0, 1.0, 1.5, 2.5],
                    help="per-engine slowdown factors, cycled (1 = the profile's own speed)")
    ap.add_argument("--fixed-k", type=int, default=2, help="k of the rr and least arms")
    ap.add_argument("--candidates", type=int, default=8, help="K chunks retrieved per request")
    ap.add_argument("--chunk-tokens", type=int, nargs="+", default=list(range(100, 261, 20)))
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--load", type=float, default=0.7, help="offered load, fraction of capacity")
    ap.add_argument("--noise", type=float, default=0.15, help="sigma of log prefill noise")
    ap.add_argument("--requests", type=int, default=3000, help="requests per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    profile = Profile.from_json(args.profile.read_text())
    print(f"# fleet_sim: profile {profile.id[:19]} ({profile.device_name}, {profile.backend}); "
          f"simulated on {machine_line()}")
    rows = []
    for n in args.engines:
        for budget in args.budgets:
            for arm in ARMS:
                row = simulate(arm, n, budget, args, profile)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'engines':>7} {'budget':>6} {'arm':>5} {'within':>7} {'refused':>7} {'mean k':>6} "
          f"{'goodput/min':>11} {'p50 ms':>7} {'p95 ms':>7}")
    for r in rows:
        def fmt(v: Any, spec: str) -> str:
            return "-" if v is None else format(v, spec)
        print(f"{r['engines']:>7} {r['budget_ms']:>6.0f} {r['arm']:>5} {r['within_budget']:>7.1%} "
              f"{r['refused']:>7.1%} {fmt(r['mean_k'], '>6.2f')} {fmt(r['goodput_per_min'], '>11.1f')} "
              f"{fmt(r['ttft_p50_ms'], '>7.0f')} {fmt(r['ttft_p95_ms'], '>7.0f')}")
    if args.out:
        settings = {k: str(v) for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"profile": profile.id, "args": settings, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
