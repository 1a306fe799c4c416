"""``python -m benchmarks.load --auth``: ``POST /v1/retrieve`` over HTTP with and without a key, same run."""

from __future__ import annotations

import argparse
import copy
import json
import random
import time

from benchmarks.common import append_jsonl, elapsed_ms, quantile_or_none
from benchmarks.load_http import Server, build


def auth(args: argparse.Namespace) -> int:
    """``POST /v1/retrieve`` over HTTP, alternately to an app with a key check and to the same
    services behind an app without one (``args.auth_requests`` each after 10 warm-up requests
    each), then the in-process key check alone. Appends one ``kind: auth`` row (p50/p95 ms of
    each side, their p50 difference, the check's p50/p95) to ``args.out``; returns 0.
    """
    import httpx

    from app.auth import create_key

    services, app, questions = build(auth=True)
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
            ms = elapsed_ms(t0)
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
        direct.append(elapsed_ms(t0))
    out = {"kind": "auth", "requests_each": args.auth_requests,
           "check_p50_ms": quantile_or_none(direct, 0.5), "check_p95_ms": quantile_or_none(direct, 0.95),
           **{f"{k}_p50_ms": quantile_or_none(v, 0.5) for k, v in times.items()},
           **{f"{k}_p95_ms": quantile_or_none(v, 0.95) for k, v in times.items()}}
    out["p50_difference_ms"] = out["with_key_p50_ms"] - out["without_key_p50_ms"]  # type: ignore[operator]
    append_jsonl(args.out, [out])
    print(json.dumps(out, indent=1))
    services.close()
    return 0
