"""LLM benchmark clients, unmodified, against ``ragbudget serve``: guidellm and NVIDIA's aiperf.

Starts ``ragbudget serve`` (auth off, loopback, the packaged SmolLM2-135M-Instruct on CPU) on
a temporary data directory holding the 5 PostgreSQL 15.18 pages of the shared corpus that
the other benchmarks use (:data:`benchmarks.generation.PAGES`), then runs each tool with its
defaults apart from a local tokenizer path (the packaged generator's Hugging Face directory,
:func:`generation.assets.ensure_packaged_generator`) and the sweep: synchronous, then
concurrency 2 and 4, ``--requests`` requests each, synthetic prompts of ``--prompt-tokens``
and ``--output-tokens`` tokens (each tool's own synthetic data), streamed chat completions.

Each tool's records lead back to receipts without matching by time: guidellm keeps every
request's ``response_id`` (``chatcmpl-<receipt id>``), aiperf with ``--export-http-trace``
every response's headers (``X-Ragbudget-Receipt-Id``). Per sweep step it prints the tool's
TTFT and ITL (mean, p50) beside the same answers' receipts (``timings.ttft_ms`` and
``tpot_ms``, fetched with ``GET /v1/receipts/{id}``), the tool's error count and how many
of its records found their receipt.

The tools live in their own virtual environments (they pin their own torch/transformers):

    python3.11 -m venv .venv-bench && .venv-bench/bin/pip install guidellm==0.8.1
    python3.11 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0
    flock /tmp/ragbudget-cpu.lock nice python -m benchmarks.clients --json benchmarks/results/clients.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import REPO, machine, quantile

STEPS = [("synchronous", 1), ("concurrent", 2), ("concurrent", 4)]
#: The ``ragbudget`` command of this interpreter (``app.cli.main``), in a subprocess.
RAGBUDGET = [sys.executable, "-m", "app.cli.main"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    """``ragbudget serve`` on ``port``; returns once ``GET /health`` answers 200 (or raises)."""
    proc = subprocess.Popen([*RAGBUDGET, "serve", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, cwd=REPO,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ragbudget serve exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"ragbudget serve did not answer /health in 300 s; see {log}")


def run_guidellm(exe: str, url: str, tokenizer: Path, kind: str, streams: int, args: argparse.Namespace,
                 out: Path) -> tuple[dict[str, Any], list[str]]:
    """One guidellm step; returns (its metrics, its records' response ids)."""
    profile = "kind=synchronous" if kind == "synchronous" else f"kind=concurrent,streams={streams}"
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={url}",
           "--profile", profile, "--constraint", f"kind=max_requests,count={args.requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                     f"output_tokens={args.output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    report = json.loads(out.read_text())
    bench = report["benchmarks"][0]
    reqs = bench["requests"]
    ok = reqs.get("successful", [])
    errored = reqs.get("errored", [])
    ttft = [r["time_to_first_token_ms"] for r in ok if r.get("time_to_first_token_ms") is not None]
    itl = [r["inter_token_latency_ms"] for r in ok if r.get("inter_token_latency_ms") is not None]
    ids = [r["response_id"] for r in ok if r.get("response_id")]
    return {"ok": len(ok), "errors": len(errored), "ttft_ms": ttft, "itl_ms": itl}, ids


def run_aiperf(exe: str, url: str, model: str, tokenizer: Path, streams: int, args: argparse.Namespace,
               out: Path) -> tuple[dict[str, Any], list[str]]:
    """One aiperf step; returns (its metrics, the receipt ids from its records' headers)."""
    cmd = [exe, "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(tokenizer), "--concurrency", str(streams),
           "--request-count", str(args.requests), "--isl", str(args.prompt_tokens),
           "--osl", str(args.output_tokens), "--artifact-dir", str(out), "--export-http-trace",
           "--random-seed", "0"]
    # Not offline: aiperf 0.13 in Hugging Face offline mode looks a local tokenizer directory up
    # as a hub repo id (snapshot_download) and fails; online, a local path is loaded as it is.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    subprocess.run(cmd, check=True, env=env)
    records = [json.loads(line) for line in next(out.rglob("profile_export.jsonl")).read_text().splitlines()
               if line.strip()]
    ttft, itl, ids, errors = [], [], [], 0
    for rec in records:
        if rec.get("error"):
            errors += 1
            continue
        metrics = rec.get("metrics", {})
        if "time_to_first_token" in metrics:
            ttft.append(float(metrics["time_to_first_token"]["value"]))
        if "inter_token_latency" in metrics:
            itl.append(float(metrics["inter_token_latency"]["value"]))
        headers = _find_headers(rec)
        rid = {k.lower(): v for k, v in headers.items()}.get("x-ragbudget-receipt-id")
        if rid:
            ids.append(rid)
    return {"ok": len(records) - errors, "errors": errors, "ttft_ms": ttft, "itl_ms": itl}, ids


def _find_headers(obj: Any) -> dict[str, str]:
    """The first ``response_headers`` mapping anywhere in an aiperf record (its HTTP trace)."""
    if isinstance(obj, dict):
        if isinstance(obj.get("response_headers"), dict):
            return obj["response_headers"]  # type: ignore[no-any-return]
        for v in obj.values():
            found = _find_headers(v)
            if found:
                return found
    elif isinstance(obj, list):
        for v in obj:
            found = _find_headers(v)
            if found:
                return found
    return {}


def receipts_of(url: str, receipt_ids: list[str]) -> dict[str, list[float]]:
    """The receipts' TTFT and TPOT (ms) and chosen k, by ``GET /v1/receipts/{id}``."""
    out: dict[str, list[float]] = {"ttft_ms": [], "tpot_ms": [], "k": [], "found": []}
    with httpx.Client(base_url=url, timeout=30) as client:
        for rid in receipt_ids:
            r = client.get(f"/v1/receipts/{rid}")
            if r.status_code != 200:
                continue
            body = r.json()["receipt"]
            out["found"].append(1.0)
            t = body.get("timings") or {}
            if t.get("ttft_ms") is not None:
                out["ttft_ms"].append(float(t["ttft_ms"]))
            if t.get("tpot_ms") is not None:
                out["tpot_ms"].append(float(t["tpot_ms"]))
            out["k"].append(float(body["plan"]["chosen_k"]))
    return out


def _stat(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{sum(values) / len(values):.1f} / {quantile(values, 0.5):.1f}"


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (module docstring) and print its table; 0 when neither tool saw an error."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=6, help="requests per sweep step")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--guidellm", default=str(REPO / ".venv-bench" / "bin" / "guidellm"),
                    help="the guidellm command (its own virtual environment)")
    ap.add_argument("--aiperf", default=str(REPO / ".venv-aiperf" / "bin" / "aiperf"),
                    help="the aiperf command (its own virtual environment)")
    ap.add_argument("--tools", default="guidellm,aiperf")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    from benchmarks.generation import DEB, HTML, extract_pages
    from generation.assets import ensure_packaged_generator

    tokenizer = ensure_packaged_generator(REPO / "ragbudget-data")
    tmp = Path(tempfile.mkdtemp(prefix="ragbudget-clients-"))
    extract_pages(DEB, tmp)
    env = {**os.environ, "RAGBUDGET_DATA_DIR": str(tmp / "data"), "RAGBUDGET_AUTH_ENABLED": "false",
           "RAGBUDGET_GENERATOR_PATH": str(tokenizer), "RAGBUDGET_GENERATOR_DEVICE": "cpu",
           "RAGBUDGET_TORCH_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    env.pop("RAGBUDGET_DATABASE_URL", None)  # the SQLite file in the data directory
    subprocess.run([*RAGBUDGET, "ingest", str(tmp / HTML)], env=env, cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(env, port, tmp / "serve.log")
    rows: list[dict[str, Any]] = []
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        m = machine()
        print(f"# {model} | {m['cpu']} | {m['cores']} cores | server torch threads {args.threads}",
              file=sys.stderr)
        for tool in args.tools.split(","):
            for kind, streams in STEPS:
                out = tmp / f"{tool}-{kind}-{streams}"
                t0 = time.time()
                if tool == "guidellm":
                    metrics, ids = run_guidellm(args.guidellm, url, tokenizer, kind, streams, args,
                                                out.with_suffix(".json"))
                    ids = [i.removeprefix("chatcmpl-") for i in ids]
                else:
                    out.mkdir()
                    metrics, ids = run_aiperf(args.aiperf, url, model, tokenizer, streams, args, out)
                rec = receipts_of(url, ids)
                rows.append({"tool": tool, "step": f"{kind}-{streams}", "wall_s": time.time() - t0,
                             "ok": metrics["ok"], "errors": metrics["errors"],
                             "receipts_found": len(rec["found"]), "tool_ttft_ms": metrics["ttft_ms"],
                             "tool_itl_ms": metrics["itl_ms"], "receipt_ttft_ms": rec["ttft_ms"],
                             "receipt_tpot_ms": rec["tpot_ms"], "receipt_k": rec["k"]})
    finally:
        server.terminate()
        server.wait(60)
    print("| tool | step | ok | errors | receipts found | TTFT tool (mean / p50 ms) | TTFT receipts "
          "| ITL tool | TPOT receipts | k (mean) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        k = r["receipt_k"]
        print(f"| {r['tool']} | {r['step']} | {r['ok']} | {r['errors']} | {r['receipts_found']} "
              f"| {_stat(r['tool_ttft_ms'])} | {_stat(r['receipt_ttft_ms'])} | {_stat(r['tool_itl_ms'])} "
              f"| {_stat(r['receipt_tpot_ms'])} | {sum(k) / len(k) if k else 0:.1f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine(), "model": model, "args": vars(args) | {
            "json": str(args.json)}, "rows": rows}, indent=1, default=str) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
