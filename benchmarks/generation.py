"""Generation through the API against a bare transformers loop, pipeline overhead, and the scaffold cache.

One run, on a few real PostgreSQL 15 documentation pages ingested into a
temporary data directory:

(a) TPOT through the API: ``ragbudget serve`` runs in a subprocess on a free
    loopback port; ``POST /v1/answer`` with ``stream: true`` is read here and every
    ``token`` event is time-stamped on arrival. TPOT (vLLM's definition) is
    ``(t_last - t_first) / (output_tokens - 1)``. The baseline is a bare greedy
    loop (``AutoModelForCausalLM`` + ``DynamicCache``, argmax, no ragbudget code)
    over the same model directory and the *same prompt token ids* (rebuilt here by
    the pipeline and checked against the server's receipt hash), for the same
    number of tokens; its output ids are checked against the receipt too. Runs are
    interleaved (API first on even repeats, bare first on odd ones); the ratio is
    of the medians (and, less sensitive to other processes, of the minima).
    Target: <= 1.05.
(b) TTFT overhead of the pipeline (validation + retrieval + planning + prompt
    assembly): wall time around ``AnswerPipeline.prepare()`` in this process, with
    the pipeline's own ``retrieval_ms`` / ``planning_ms`` split, plus the server's
    own ``overhead_ms`` and ``ttft_ms`` from the streamed answers.
(c) The warm/cold scaffold TTFT table: ``benchmarks/prefix_cache.py`` is run
    as is (its ``main()``), on the same model and thread count.

Threads: ``--threads`` torch threads in the server and here (default 1, so the
second core serves HTTP). Other processes' CPU share during (a) and (b) is
printed (the server subprocess is not counted as "other").

    python -m benchmarks.generation                  # --tokens 64 --repeats 7 --threads 1
    python -m benchmarks.generation --no-table       # skip (c)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO as ROOT
from benchmarks.common import elapsed_ms, quantile

DEB = ROOT.parent / "shared" / "corpora" / "postgresql-doc-15_15.18-0+deb12u1_all.deb"
HTML = "usr/share/doc/postgresql-doc-15/html"
PAGES = ["backup-dump.html", "sql-vacuum.html", "sql-analyze.html", "indexes-types.html",
         "runtime-config-autovacuum.html"]
QUESTION = "How do I dump a database with pg_dump, and how do I restore it?"
BUDGET_MS = 60_000.0


# --- set-up -------------------------------------------------------------------------------------
def extract_pages(deb: Path, dest: Path) -> dict[str, str]:
    """The text of ``PAGES`` from the Debian package (``dpkg-deb --fsys-tarfile | tar -x``)."""
    from retrieval.extract import html_to_text

    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest), *[f"./{HTML}/{p}" for p in PAGES]], input=tar, check=True)
    return {p: html_to_text((dest / HTML / p).read_bytes()) for p in PAGES}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(env: dict[str, str], cwd: Path, port: int) -> subprocess.Popen[bytes]:
    """``ragbudget serve`` (models and scaffold cache warmed before it listens); waits for /healthz."""
    import httpx

    script = Path(sys.executable).with_name("ragbudget")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "app.cli.main"]
    log = (cwd / "serve.log").open("wb")
    proc = subprocess.Popen([*cmd, "serve", "--host", "127.0.0.1", "--port", str(port)], env=env, cwd=cwd,
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"ragbudget serve exited: {(cwd / 'serve.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("ragbudget serve did not start")


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` from ``/proc/<pid>/stat``; 0 when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class OtherLoad:
    """Share of all cores used by processes other than this one and the server, over a phase."""

    def __init__(self, server_pid: int | None) -> None:
        from latency_model.probe import cpu_snapshot

        self.server_pid = server_pid
        self.start = cpu_snapshot()
        self.server0 = proc_cpu_s(server_pid) if server_pid else 0.0

    def fraction(self) -> float | None:
        from latency_model.probe import cpu_snapshot

        end = cpu_snapshot()
        if self.start is None or end is None:
            return None
        server = (proc_cpu_s(self.server_pid) - self.server0) if self.server_pid else 0.0
        busy = (end[0] - self.start[0]) - (end[1] - self.start[1]) - server
        wall = end[2] - self.start[2]
        return max(0.0, min(1.0, busy / (wall * (os.cpu_count() or 1))))


# --- (a) TPOT -----------------------------------------------------------------------------------
def api_answer(base_url: str, max_new: int) -> dict[str, Any]:
    """One streamed ``/v1/answer``: arrival times of token events and the final summary."""
    import httpx

    times: list[float] = []
    final: dict[str, Any] = {}
    event = "message"
    body = {"question": QUESTION, "ttft_budget_ms": BUDGET_MS, "max_new_tokens": max_new, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/answer", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line:
                event = "message"
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                if event == "token":
                    times.append(time.perf_counter())
                elif event in ("final", "error"):
                    final = json.loads(line[5:])
    if final.get("status") != "ok":
        raise SystemExit(f"answer failed: {final}")
    n = int(final["tokens"]["output"])
    return {"t0": t0, "times": times, "final": final, "output_tokens": n,
            "tpot_ms": (times[-1] - times[0]) * 1000.0 / (n - 1), "client_ttft_ms": (times[0] - t0) * 1000.0}


def bare_greedy(model: Any, prompt_ids: list[int], new_tokens: int) -> dict[str, Any]:
    """A minimal transformers greedy loop with a KV cache: prefill, then one token per forward."""
    import torch
    from transformers import DynamicCache

    out: list[int] = []
    times: list[float] = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        x = torch.tensor([prompt_ids], dtype=torch.long)
        for _ in range(new_tokens):
            logits = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            tok = int(torch.argmax(logits).item())
            times.append(time.perf_counter())
            out.append(tok)
            x = torch.tensor([[tok]], dtype=torch.long)
    return {"ids": out, "tpot_ms": (times[-1] - times[0]) * 1000.0 / (len(out) - 1)}


# --- the three measurements ----------------------------------------------------------------------
def measure_overhead(pipeline: Any, req: Any, repeats: int) -> tuple[Any, dict[str, list[float]]]:
    """(b) ``repeats`` x ``pipeline.prepare(req)``: wall ms and the pipeline's own split."""
    out: dict[str, list[float]] = {"wall": [], "retrieval": [], "planning": []}
    prepared = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        prepared = pipeline.prepare(req)
        out["wall"].append(elapsed_ms(t0))
        out["retrieval"].append(prepared.timings_ms["retrieval_ms"])
        out["planning"].append(prepared.timings_ms["planning_ms"])
    return prepared, out


def measure_tpot(base_url: str, bare: Any, prompt_ids: list[int], tokens: int,
                 repeats: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(a) interleaved API answers and bare loops over the same prompt ids and token count."""
    api_answer(base_url, 4)  # warm-up: first HTTP request, first answer
    bare_greedy(bare, prompt_ids, 4)
    api_runs: list[dict[str, Any]] = []
    bare_runs: list[dict[str, Any]] = []
    for i in range(repeats):
        for which in (("api", "bare") if i % 2 == 0 else ("bare", "api")):
            if which == "api":
                api_runs.append(api_answer(base_url, tokens))
            else:
                n = api_runs[-1]["output_tokens"] if api_runs else tokens
                bare_runs.append(bare_greedy(bare, prompt_ids, n))
    return api_runs, bare_runs


def print_tpot(api_runs: list[dict[str, Any]], bare_runs: list[dict[str, Any]], prompt_ids: list[int],
               receipt: dict[str, Any], other: float | None) -> None:
    from foundation.hashing import sha256_ints

    n_out = api_runs[0]["output_tokens"]
    same_prompt = receipt["prompt"]["token_ids_hash"] == sha256_ints(prompt_ids)
    same_output = receipt["output"]["token_ids"][:n_out] == bare_runs[0]["ids"][:n_out]
    api = [r["tpot_ms"] for r in api_runs]
    server = [r["final"]["timings"]["tpot_ms"] for r in api_runs]
    bare = [r["tpot_ms"] for r in bare_runs]
    print(f"\n## (a) TPOT through the API vs a bare greedy loop ({len(api_runs)} interleaved pairs, "
          f"prompt {len(prompt_ids)} tokens, {n_out} output tokens, other processes' CPU {_pct(other)})\n")
    print("| path | TPOT median ms | min | max |")
    print("|---|---:|---:|---:|")
    for name, runs in (("POST /v1/answer stream, client-side", api),
                       ("same answers, server-side (receipt tpot_ms)", server),
                       ("bare transformers greedy loop", bare)):
        print(f"| {name} | {statistics.median(runs):.2f} | {min(runs):.2f} | {max(runs):.2f} |")
    med = statistics.median
    print(f"\nratio API / bare = **{med(api) / med(bare):.3f}** of medians (target <= 1.05), "
          f"{min(api) / min(bare):.3f} of minima (the least disturbed runs); server-side / bare = "
          f"{med(server) / med(bare):.3f}. Same prompt ids as the receipt: {same_prompt}; "
          f"same greedy output ids: {same_output}.")


def print_overhead(times: dict[str, list[float]], api_runs: list[dict[str, Any]], k: Any, candidates: int,
                   other: float | None) -> None:
    ttft = [r["final"]["timings"]["ttft_ms"] for r in api_runs]
    over_ms = [r["final"]["timings"]["overhead_ms"] for r in api_runs]
    print(f"\n## (b) TTFT overhead of the pipeline ({len(times['wall'])} x prepare(), K={candidates}, "
          f"chosen k={k}, other processes' CPU {_pct(other)})\n")
    print("| measure | median ms | p95 ms |")
    print("|---|---:|---:|")
    for name, vals in (("prepare() wall: validation + retrieval + planning + assembly", times["wall"]),
                       ("  retrieval (query embedding + search + fetch)", times["retrieval"]),
                       ("  planning + prompt assembly (both builds, profile, plan)", times["planning"]),
                       ("server overhead_ms in the API answers (arrival to planning)", over_ms),
                       ("server TTFT in the same answers (queue + pipeline + prefill)", ttft)):
        print(f"| {name} | {statistics.median(vals):.1f} | {quantile(vals, 0.95):.1f} |")
    print(f"\npipeline share of TTFT: {statistics.median(times['wall']) / statistics.median(ttft):.1%}")


def scaffold_table(model_dir: Path, threads: int, repeats: int) -> None:
    """(c) ``python -m benchmarks.prefix_cache`` run as is, its table printed under a heading."""
    from benchmarks import prefix_cache

    buf = io.StringIO()
    old, sys.argv = sys.argv, ["prefix_cache.py", "--model-dir", str(model_dir), "--device", "cpu",
                               "--threads", str(threads), "--repeats", str(repeats)]
    load = OtherLoad(None)
    try:
        with contextlib.redirect_stdout(buf):
            prefix_cache.main()
    finally:
        sys.argv = old
    print(f"\n## (c) warm vs cold scaffold TTFT (benchmarks/prefix_cache.py, other processes' CPU "
          f"{_pct(load.fraction())})\n")
    print(buf.getvalue().rstrip())


# --- main ---------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deb", type=Path, default=DEB)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (server and here)")
    ap.add_argument("--tokens", type=int, default=64, help="max_new_tokens of the timed answers")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved API/bare pairs")
    ap.add_argument("--prepare-repeats", type=int, default=30)
    ap.add_argument("--candidates", type=int, default=3, help="K retrieved (all fit the budget)")
    ap.add_argument("--no-table", action="store_true", help="skip the warm/cold scaffold table")
    ap.add_argument("--table-repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the temporary data directory")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from app.answering.pipeline import AnswerPipeline
    from app.answering.state import AnswerRequest
    from app.services import Services
    from app.settings import get_settings
    from generation.assets import ensure_packaged_generator
    from receipts.chain import get_receipt
    from retrieval.chunking import ChunkerConfig
    from retrieval.store import IngestItem, ingest_batch

    torch.set_num_threads(args.threads)
    model_dir = ensure_packaged_generator(ROOT / "ragbudget-data")
    tmp = Path(tempfile.mkdtemp(prefix="ragbudget-genbench-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        texts = extract_pages(args.deb, tmp)
        over = {"data_dir": str(tmp / "data"), "auth_enabled": "false", "generator_path": str(model_dir),
                "generator_device": "cpu", "torch_threads": str(args.threads),
                "retrieval_candidates": str(args.candidates), "default_ttft_budget_ms": str(BUDGET_MS)}
        settings = get_settings(**over)  # type: ignore[arg-type]
        services = Services(settings)
        ingest_batch(services.engine, [IngestItem(document_id=p, text=t) for p, t in texts.items()],
                     tokenizer=services.tokenizer, embedder=services.embedder,
                     chunker_config=ChunkerConfig(settings.chunk_tokens, settings.chunk_overlap_tokens))
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAGBUDGET_")}
        env.update({f"RAGBUDGET_{k.upper()}": v for k, v in over.items()})
        port = free_port()
        proc = start_server(env, tmp, port)
        pipeline = AnswerPipeline(services)
        pipeline.warm()
        bare = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                    local_files_only=True).eval()
        ident = services.generator.identity
        print(f"# {ident['model_id']} | {ident['device_name']} | {ident['dtype']} | torch threads "
              f"{args.threads} | cores {os.cpu_count()} | loadavg at start {os.getloadavg()[0]:.2f}")

        load_b = OtherLoad(proc.pid)  # (b) first, in process, while the server idles
        req = AnswerRequest(question=QUESTION, ttft_budget_ms=BUDGET_MS, max_new_tokens=args.tokens)
        prepared, times = measure_overhead(pipeline, req, args.prepare_repeats)
        other_b = load_b.fraction()
        prompt_ids = list(prepared.prompt.ids)
        load_a = OtherLoad(proc.pid)
        api_runs, bare_runs = measure_tpot(f"http://127.0.0.1:{port}", bare, prompt_ids, args.tokens,
                                           args.repeats)
        other_a = load_a.fraction()
        receipt = get_receipt(services.engine, api_runs[0]["final"]["receipt_id"])
        proc.terminate()
        proc.wait(30)
        proc = None
        print_tpot(api_runs, bare_runs, prompt_ids, receipt, other_a)
        print_overhead(times, api_runs, prepared.plan.chosen_k, args.candidates, other_b)
        services.close()
        del bare
        if not args.no_table:
            scaffold_table(model_dir, args.threads, args.table_repeats)
        print(f"\n# loadavg at end {os.getloadavg()[0]:.2f}")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


if __name__ == "__main__":
    main()
