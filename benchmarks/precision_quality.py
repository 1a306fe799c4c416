"""Quality guard of the local engine's bf16 and int8 precisions against fp32 (docs/precision.md).

Two measures, same model (the packaged SmolLM2-135M-Instruct), same machine, one run:

* **Greedy agreement**: the first ``--questions`` terms of the PostgreSQL 15.20 docs'
  back-of-book index (``bookindex.html``, :func:`retrieval.bookindex.parse_bookindex`, the
  retrieval-quality set) asked as "What is <term> in PostgreSQL?" with the real prompt (the
  default scaffold, then the start of the term's first indexed page as one chunk, then the
  question; :class:`app.prompting.prompt.PromptBuilder`), answered greedily to ``--max-new`` tokens by
  the engine in fp32 and in each other precision of ``--precisions`` (bf16, int8). Reported,
  per precision against fp32: answers identical token for token, and the mean share of the
  answer before the first differing token.
* **Log-likelihood**: mean per-token negative log-likelihood (nats) of held-out corpus text
  (``--nll-pages``, pages not in the question set), windows of ``--window`` tokens, the
  model's full forward (transformers' SDPA attention) in fp32 and with the same linear layers
  as the engine's precision (:func:`generation.precision.apply_precision`).

    flock /tmp/ragbudget-cpu.lock .venv/bin/python -m benchmarks.precision_quality --json out.json
    flock /tmp/ragbudget-cpu.lock .venv/bin/python -m benchmarks.precision_quality --precisions fp32,int8
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, machine_line

CORPORA = REPO.parent / "shared" / "corpora"
NLL_PAGES = "backup-dump.html,routine-vacuuming.html,continuous-archiving.html,wal-intro.html,mvcc-intro.html"


def _agreement(a: list[int], b: list[int]) -> float:
    """Share of the longer answer before the first differing token (1.0 when identical)."""
    n = max(len(a), len(b), 1)
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    return 1.0 if a == b else same / n


def greedy(gens: dict[str, Any], corpus: Path, n: int, max_new: int) -> dict[str, Any]:
    """Greedy answers of each generator to the first ``n`` book-index questions, each compared
    with the first generator's (fp32): ``{name: {identical, mean_agreement, differing}}`` plus
    the shared counts."""
    from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder, PromptChunk
    from generation.base import GenParams
    from retrieval.bookindex import parse_bookindex
    from retrieval.extract import html_to_text

    evalset = parse_bookindex((corpus / "bookindex.html").read_text(encoding="utf-8"))
    items = [(q, sorted(p)[0]) for q, p in evalset if p and (corpus / sorted(p)[0]).exists()][:n]
    out: dict[str, list[list[int]]] = {k: [] for k in gens}
    first = next(iter(gens.values()))
    builder = PromptBuilder.for_generator(first)
    for q, page in items:
        text = html_to_text((corpus / page).read_bytes())[:1200]
        prompt = builder.build(DEFAULT_SCAFFOLD_TEXT, [PromptChunk(1, 1, text)],
                               f"What is {q} in PostgreSQL?")
        params = GenParams(max_new_tokens=max_new)
        for name, g in gens.items():  # interleaved, one question at a time
            out[name].append([e.token_id for e in g.stream(prompt.ids, params=params)])
    names = list(gens)
    res: dict[str, Any] = {"questions": len(items), "max_new_tokens": max_new}
    a = out[names[0]]
    for name in names[1:]:
        b = out[name]
        agree = [_agreement(x, y) for x, y in zip(a, b, strict=True)]
        res[name] = {"identical": sum(x == y for x, y in zip(a, b, strict=True)),
                     "mean_agreement": sum(agree) / max(1, len(agree)),
                     "differing": [{"question": items[i][0], names[0]: first.tokenizer.decode(a[i]),
                                    name: first.tokenizer.decode(b[i])}
                                   for i in range(len(items)) if a[i] != b[i]]}
    return res


def nll(model_dir: Path, corpus: Path, pages: list[str], window: int, threads: int,
        precisions: tuple[str, ...] = ("fp32", "bf16")) -> dict[str, Any]:
    """Mean per-token NLL (nats) of ``pages``' text in each of ``precisions`` (the first is the
    reference: ``nll_diff``/``nll_rel_diff`` per other precision)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generation.precision import apply_precision
    from retrieval.extract import html_to_text

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids: list[int] = []
    for p in [p for p in pages if (corpus / p).exists()]:
        ids += tok(html_to_text((corpus / p).read_bytes()))["input_ids"]
    windows = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    res: dict[str, Any] = {"pages": pages, "tokens": len(windows) * (window - 1), "window": window}
    for precision in precisions:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
        apply_precision(model, precision)
        total, count = 0.0, 0
        with torch.inference_mode():
            for w in windows:
                x = torch.tensor([w])
                logits = model(input_ids=x).logits[0, :-1].float()  # (window-1, vocab)
                lp = torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None])[:, 0]
                total -= float(lp.sum())
                count += int(lp.numel())
        res[precision] = {"mean_nll": total / count, "perplexity": math.exp(total / count)}
    ref = res[precisions[0]]["mean_nll"]
    for precision in precisions[1:]:
        res[precision]["nll_diff"] = res[precision]["mean_nll"] - ref
        res[precision]["nll_rel_diff"] = res[precision]["nll_diff"] / ref
    return res


def main(argv: list[str] | None = None) -> int:
    """Print (and optionally write) the greedy agreement and NLL figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=REPO / "data" / "bench")
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--nll-pages", default=NLL_PAGES)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--precisions", default="fp32,bf16", help="the first is the reference")
    a = ap.parse_args(argv)
    precisions = tuple(a.precisions.split(","))

    from generation.assets import ensure_packaged_generator
    from generation.local import LocalGenerator
    from retrieval.corpus import fetch_postgres_docs

    t0 = time.perf_counter()
    print(f"machine: {machine_line()}; {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC", file=sys.stderr)
    corpus = Path(fetch_postgres_docs(a.data_dir, "15.20", search_dirs=[CORPORA]).path)
    model_dir = ensure_packaged_generator(REPO / "ragbudget-data")
    gens = {p: LocalGenerator(model_dir, device="cpu", threads=a.threads, precision=p)
            for p in precisions}
    res: dict[str, Any] = {"machine": machine_line(),
                           "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    res["greedy"] = greedy(gens, corpus, a.questions, a.max_new)
    g = res["greedy"]
    for p in precisions[1:]:
        print(f"greedy {p}: {g[p]['identical']}/{g['questions']} answers identical to {precisions[0]} over "
              f"{g['max_new_tokens']} tokens, mean agreement {g[p]['mean_agreement']:.3f}", file=sys.stderr)
    del gens
    res["nll"] = nll(model_dir, corpus, a.nll_pages.split(","), a.window, a.threads, precisions)
    n = res["nll"]
    for p in precisions[1:]:
        print(f"nll over {n['tokens']} tokens: {precisions[0]} {n[precisions[0]]['mean_nll']:.4f}, "
              f"{p} {n[p]['mean_nll']:.4f} "
              f"(diff {n[p]['nll_diff']:+.4f} nats, {100 * n[p]['nll_rel_diff']:+.2f} %)", file=sys.stderr)
    res["wall_s"] = time.perf_counter() - t0
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
