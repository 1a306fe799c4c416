"""The same prefill timed by calibration's timer and served as an answer, in one process.

PyTorch's CPU wheel runs intra-op work on OpenMP (libgomp). Each application thread that runs
a parallel region gets its own OpenMP team, and once the process holds more OpenMP threads
than CPUs, libgomp's idle team threads spin only briefly before sleeping, so each parallel
region after a short gap pays a wake-up. Calibration's timer (``LocalGenerator.prefill_ms``)
and served answers (``LocalGenerator.stream`` through the engine) must therefore run on one
team, or the profile describes a faster machine than the one answers run on
(``foundation.compute``).

This prints, with the OpenMP settings in the environment:

* ``alone``: the median of ``--repeat`` ``prefill_ms(tokens, cached)`` calls made from the
  main thread before any other thread has run torch work (a ``ragbudget calibrate`` process);
* ``timer``: the same after the request threads below have each embedded and answered once
  (calibration inside a serving process);
* ``served``: the median prefill (``GenerationStats.prefill_ms``: cache copy, prefill, first
  token) of ``--repeat`` one-token answers of the same prompt with the same cached scaffold,
  one at a time, each asked from the next of four request threads after a query embedding
  on that thread (what ``POST /v1/answer`` does before it generates);
* ``served_over_alone`` and ``served_over_timer``: the ratios (1.0: the profile describes
  served answers).

    RAGBUDGET_DATA_DIR=ragbudget-data python -m benchmarks.omp_pools
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from concurrent.futures import ThreadPoolExecutor


def main(argv: list[str] | None = None) -> int:
    """Time the prefills and print one JSON line; 0 on success."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=906)
    ap.add_argument("--cached", type=int, default=83)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    from app.services import Services
    from app.settings import get_settings
    from benchmarks.common import cpu_model
    from generation.base import GenParams

    services = Services(get_settings())
    gen = services.generator
    embedder = services.embedder
    ids = gen._synthetic_ids(args.tokens)  # the timer's own prompt

    def served(i: int) -> float:
        embedder.embed_query(f"how do I vacuum a table {i}")
        answer = gen.stream(ids, cached_prefix_ids=ids[:args.cached], params=GenParams(max_new_tokens=1))
        for _ in answer:
            pass
        stats = answer.stats
        assert stats is not None and stats.cached_tokens == args.cached, stats
        return float(stats.prefill_ms)

    try:
        gen.prefill_ms(args.tokens, args.cached)  # first call: loads and allocates, untimed
        gen.warm_prefix(ids[:args.cached])
        # Before any request thread exists: the process as `ragbudget calibrate` runs it.
        alone = [gen.prefill_ms(args.tokens, args.cached) for _ in range(args.repeat)]
        # Four request threads, asked in turn, one answer at a time (an answer alone).
        pools = [ThreadPoolExecutor(1, thread_name_prefix=f"request-{i}") for i in range(4)]
        try:
            for i, pool in enumerate(pools):  # every request thread has embedded and asked once
                pool.submit(served, i).result()
            timer = [gen.prefill_ms(args.tokens, args.cached) for _ in range(args.repeat)]
            answers = [pools[i % 4].submit(served, i).result() for i in range(args.repeat)]
        finally:
            for pool in pools:
                pool.shutdown()
    finally:
        services.close()
    med_a, med_t, med_s = (statistics.median(alone), statistics.median(timer),
                           statistics.median(answers))
    print(json.dumps({"cpu": cpu_model(), "cores": os.cpu_count(), "tokens": args.tokens,
                      "cached": args.cached, "repeat": args.repeat,
                      "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                              "GOMP_SPINCOUNT")},
                      "alone_ms": alone, "timer_ms": timer, "served_ms": answers,
                      "alone_median_ms": med_a, "timer_median_ms": med_t,
                      "served_median_ms": med_s, "served_over_timer": med_s / med_t,
                      "served_over_alone": med_s / med_a}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
