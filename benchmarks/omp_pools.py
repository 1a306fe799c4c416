"""The same prefill timed on the main thread and on a second thread of one process.

PyTorch's CPU wheel runs intra-op work on OpenMP (libgomp). Each application thread that runs
a parallel region gets its own OpenMP team, and once the process holds more OpenMP threads
than CPUs, libgomp's idle team threads spin only briefly before sleeping (its "throttled"
spin count), so each parallel region after a short gap pays a wake-up. The answer engine runs
its steps on its own thread (``generation.scheduler.Engine``) while the main thread that loaded
the model keeps its team; calibration's timers (``LocalGenerator.prefill_ms``) ran on the
calling thread. This prints the median of ``--repeat`` prefills of ``--tokens`` tokens with
``--cached`` cached, on the main thread and then on a new thread, and their ratio, with the
OpenMP settings in the environment; run it under ``OMP_WAIT_POLICY=PASSIVE`` (idle threads
sleep at once: the main thread pays the wake-ups too) or ``ACTIVE`` to compare.

    RAGBUDGET_DATA_DIR=ragbudget-data python benchmarks/omp_pools.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    """Time the prefills and print one JSON line; 0 on success."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=906)
    ap.add_argument("--cached", type=int, default=83)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    from app.services import Services
    from app.settings import get_settings
    from foundation.machine import cpu_model

    services = Services(get_settings())
    gen = services.generator
    got: dict[str, list[float]] = {}

    def timed(where: str) -> None:
        got[where] = [gen.prefill_ms(args.tokens, args.cached) for _ in range(args.repeat)]

    try:
        gen.prefill_ms(args.tokens, args.cached)  # first call: loads and allocates, untimed
        timed("main")
        t = threading.Thread(target=timed, args=("thread",))
        t.start()
        t.join()
    finally:
        services.close()
    med = {k: statistics.median(v) for k, v in got.items()}
    print(json.dumps({"cpu": cpu_model(), "cores": os.cpu_count(), "tokens": args.tokens,
                      "cached": args.cached, "repeat": args.repeat,
                      "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                              "GOMP_SPINCOUNT")},
                      "main_ms": got["main"], "thread_ms": got["thread"],
                      "main_median_ms": med["main"], "thread_median_ms": med["thread"],
                      "thread_over_main": med["thread"] / med["main"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
