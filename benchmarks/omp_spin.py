"""A prefill idle and beside a CPU hog, per libgomp spin count (``GOMP_SPINCOUNT``).

libgomp reads ``GOMP_SPINCOUNT`` once, when torch loads it, so each setting runs in a fresh
child process. Each child loads the main job's generator (2 threads), times ``--repeat``
``prefill_ms(--tokens, --cached)`` calls on the quiet machine, starts one busy process (a
pure-Python loop), times ``--repeat`` more, and stops it. The settings run in turn,
``--rounds`` times, interleaved; one JSON line per child, then one summary line with the
medians per setting. The variable is always set in the child, so the project's own default
(``foundation.GOMP_SPINCOUNT``) never applies; libgomp's own default is 300000. ``passive``
sets ``OMP_WAIT_POLICY=PASSIVE`` (and an empty ``GOMP_SPINCOUNT``, which libgomp ignores).

    RAGBUDGET_DATA_DIR=ragbudget-data python -m benchmarks.omp_spin --spins 300000,3000,1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import REPO


def child(tokens: int, cached: int, repeat: int) -> dict[str, object]:
    """In a child: time the prefills idle and beside the hog; ms lists."""
    from app.services import Services
    from app.settings import get_settings

    services = Services(get_settings())
    gen = services.generator
    try:
        gen.prefill_ms(tokens, cached)  # loads and allocates, untimed
        idle = [gen.prefill_ms(tokens, cached) for _ in range(repeat)]
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)
            hog = [gen.prefill_ms(tokens, cached) for _ in range(repeat)]
        finally:
            busy.terminate()
            busy.wait(10)
    finally:
        services.close()
    return {"idle_ms": idle, "hog_ms": hog}


def main(argv: list[str] | None = None) -> int:
    """Run the children and print their lines and a summary; 0 on success."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spins", default="300000,3000,1000",
                    help="comma-separated GOMP_SPINCOUNT values, or 'passive'")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--cached", type=int, default=83)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.tokens, args.cached, args.repeat)))
        return 0

    from benchmarks.common import cpu_model

    got: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for spin in args.spins.split(","):
            env = {k: v for k, v in os.environ.items()
                   if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
            if spin == "passive":
                env.update(OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT="")
            else:
                env["GOMP_SPINCOUNT"] = spin
            out = subprocess.run([sys.executable, "-m", "benchmarks.omp_spin", "--child",
                                  "--tokens", str(args.tokens), "--cached", str(args.cached),
                                  "--repeat", str(args.repeat)],
                                 env=env, capture_output=True, text=True, check=True, cwd=REPO)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            idle, hog = statistics.median(row["idle_ms"]), statistics.median(row["hog_ms"])
            got.setdefault(spin, []).append((idle, hog))
            print(json.dumps({"spin": spin, "idle_median_ms": idle, "hog_median_ms": hog, **row}),
                  flush=True)
    print(json.dumps({"cpu": cpu_model(), "cores": os.cpu_count(), "tokens": args.tokens,
                      "cached": args.cached, "repeat": args.repeat, "rounds": args.rounds,
                      "medians": {s: {"idle_ms": statistics.median(i for i, _ in v),
                                      "hog_ms": statistics.median(h for _, h in v)}
                                  for s, v in got.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
