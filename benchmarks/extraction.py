"""HTML extraction fidelity on real doc sets: boilerplate kept, code blocks intact, tables intact.

    python -m benchmarks.extraction DIR [DIR ...] [--extractors ragbudget,html2text,inscriptis]
                                    [--limit N] [--json]
    python -m benchmarks.extraction --diff DIR [--baseline-rev main]

For each folder (every ``*.html`` below it, sorted; ``--limit`` keeps every
n-th page so the sample spans the set) and each extractor, the script prints:

* ``boilerplate``: the share of the output's characters that come from site
  chrome. Chrome is decided from the markup, independently of any extractor:
  ``<nav>``, ``<aside>``, page-level ``<header>``/``<footer>``, the ARIA roles
  banner, navigation, contentinfo, complementary and search, plus the chrome the
  three sets are known to use without such markup (DocBook ``div.navheader`` /
  ``div.navfooter``; Sphinx ``div.related``, ``div.sphinxsidebar``,
  ``div.footer``, ``div.mobile-nav``, ``a.headerlink``; SQLite's site header
  ``div.nosearch``). The share is counted in three-word shingles (lower case,
  punctuation and Markdown markup ignored): the output's shingles that occur in
  the chrome's text and nowhere else on the page, over all the output's shingles.
* ``code intact``: the share of ``<pre>`` blocks (outside chrome, at least two
  non-empty lines, ``<br>`` as a line break) whose lines appear in the output
  as consecutive lines, in order (each line compared with surrounding
  whitespace stripped, so indented Markdown code blocks count).
* ``tables intact``: the share of table rows (outside chrome, two or more
  non-empty cells) whose cells' texts all appear on one output line, in order
  (compared without spaces, since markup-derived text puts spaces before
  punctuation that a browser would not show).
* ``ms/page``: extraction wall time per page (``time.perf_counter``).

``ragbudget`` is what ``ragbudget ingest DIR`` stores when the folder is one
batch: ``retrieval.extract.extract_text``, then the boilerplate learned from
*every* page of the folder (``retrieval.boilerplate``; that learning pass is
timed and reported separately) dropped from each page's edges;
``ragbudget@REV`` is ``extract_text`` as of git revision ``REV`` (per page,
without the batch step, which did not exist before);
``html2text``, ``inscriptis`` and ``markdownify`` are run when installed, on
the whole page, with links and images off. Texts are compared after
``foundation.hashing.normalize_text`` on both sides.

``--diff`` compares the stored text of every page under ``DIR`` between the
extraction and normalisation at ``--baseline-rev`` (read with ``git show``) and
the working tree with ``DIR`` as one batch (boilerplate learned and dropped):
how many pages a re-ingest would re-version, and why.

Numbers are for comparison in one run; the script prints the CPU model and the
load average before and after, and asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, machine

CHROME_TAGS = ("nav", "aside")
CHROME_PAGE_TAGS = ("header", "footer")
CHROME_ROLES = ("banner", "navigation", "contentinfo", "complementary", "search")
CHROME_CLASSES = ("navheader", "navfooter", "related", "sphinxsidebar", "footer", "mobile-nav", "headerlink",
                  "nosearch")
_WS = re.compile(r"\s+")


def cpu_model() -> str:
    """The CPU model name and the number of cores."""
    m = machine()
    return f"{m['cpu']}, {m['cores']} cores"


def _norm(text: str) -> str:
    from foundation.hashing import normalize_text

    return _WS.sub(" ", normalize_text(text)).strip()


_WORD = re.compile(r"\w+")


def _shingles(text: str) -> set[tuple[str, ...]]:
    """Overlapping three-word sequences of ``text`` (lower case, punctuation and markup ignored)."""
    words = _WORD.findall(_norm(text).lower())
    return {tuple(words[i:i + 3]) for i in range(len(words) - 2)}


def _soup(raw: bytes) -> Any:
    from bs4 import BeautifulSoup, XMLParsedAsHTMLWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", XMLParsedAsHTMLWarning)
        return BeautifulSoup(raw, "lxml")


def _is_chrome(tag: Any) -> bool:
    if tag.name in CHROME_TAGS or str(tag.get("role") or "").lower() in CHROME_ROLES:
        return True
    if tag.name in CHROME_PAGE_TAGS and tag.find_parent(["article", "section", "main"]) is None:
        return True
    return bool(set(tag.get("class") or ()) & set(CHROME_CLASSES))


def _in_chrome(tag: Any) -> bool:
    return any(_is_chrome(p) for p in [tag, *tag.parents] if getattr(p, "name", None))


def _pre_lines(pre: Any) -> list[str]:
    for br in pre.find_all("br"):
        br.replace_with("\n")
    return [_norm(x) for x in pre.get_text().split("\n") if _norm(x)]


def page_facts(raw: bytes) -> dict[str, Any]:
    """Chrome texts, code blocks (as line lists) and table rows (as cell lists) of one page."""
    soup = _soup(raw)
    for t in soup(["script", "style", "noscript", "template"]):
        t.decompose()
    chrome = [t for t in soup.find_all(True) if _is_chrome(t)]
    outer = [t for t in chrome if not any(_is_chrome(p) for p in t.parents if getattr(p, "name", None))]
    chrome_shingles = {sh for t in outer for sh in _shingles(t.get_text(" "))}
    for t in outer:
        t.extract()
    chrome_only = chrome_shingles - _shingles(soup.get_text(" "))
    code = [lines for pre in soup.find_all("pre") if not _in_chrome(pre)
            for lines in [_pre_lines(pre)] if len(lines) >= 2]
    rows = []
    for tr in soup.find_all("tr"):
        if _in_chrome(tr) or tr.find("tr"):
            continue
        cells = [_norm(c.get_text(" ")) for c in tr.find_all(["td", "th"], recursive=False)]
        cells = [c for c in cells if c]
        if len(cells) >= 2:
            rows.append(cells)
    return {"chrome": chrome_only, "code": code, "rows": rows}


def score(facts: dict[str, Any], output: str) -> dict[str, float]:
    """Counts for one page: chrome characters kept, total output characters, intact code and rows."""
    flat = _norm(output)
    lines = [_norm(x) for x in output.split("\n")]
    lines = [x for x in lines if x]
    joined = "\n".join(lines)
    words = _WORD.findall(flat.lower())
    shingles = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    kept = sum(1 for sh in shingles if sh in facts["chrome"])
    code_ok = sum(1 for block in facts["code"] if "\n".join(block) in joined)

    squeezed = [x.replace(" ", "") for x in lines]

    def row_ok(cells: list[str]) -> bool:
        for line in squeezed:
            pos = 0
            for c in (x.replace(" ", "") for x in cells):
                pos = line.find(c, pos)
                if pos < 0:
                    break
                pos += len(c)
            else:
                return True
        return False

    rows_ok = sum(1 for r in facts["rows"] if row_ok(r))
    return {"chrome_kept": kept, "chars": len(shingles), "code": len(facts["code"]), "code_ok": code_ok,
            "rows": len(facts["rows"]), "rows_ok": rows_ok}


def extractors(names: list[str]) -> dict[str, Callable[[bytes], str]]:
    """The named extractors that can run here (a library that is not installed is left out)."""
    out: dict[str, Callable[[bytes], str]] = {}
    for name in names:
        if name == "ragbudget":
            from retrieval.extract import extract_text

            out[name] = lambda raw: extract_text(raw, "html")
        elif name.startswith("ragbudget@"):
            old = _baseline_module(name.split("@", 1)[1], Path(tempfile.mkdtemp(prefix="rb-extract-")))
            out[name] = lambda raw, _m=old: str(_m.extract_text(raw, "html"))
        elif name == "html2text":
            try:
                import html2text
            except ImportError:
                continue

            def h2t(raw: bytes, _m: Any = html2text) -> str:
                conv = _m.HTML2Text()
                conv.body_width, conv.ignore_links, conv.ignore_images = 0, True, True
                return str(conv.handle(raw.decode("utf-8", "replace")))

            out[name] = h2t
        elif name == "inscriptis":
            try:
                import inscriptis
            except ImportError:
                continue
            out[name] = lambda raw, _m=inscriptis: str(_m.get_text(raw.decode("utf-8", "replace")))
        elif name == "markdownify":
            try:
                import markdownify
            except ImportError:
                continue
            out[name] = lambda raw, _m=markdownify: str(_m.markdownify(raw.decode("utf-8", "replace"),
                                                                       strip=["a", "img"]))
    return out


def learn_folder(folder: Path) -> dict[str, Any]:
    """Extract every page under ``folder`` and learn its boilerplate as one batch would.

    Returns ``{"texts": {path: text}, "learned": {key: LearnedBlock}, "pages", "s"}``
    (pages that do not extract are left out, as ingest rejects them).
    """
    from foundation.errors import InvalidInput
    from retrieval.boilerplate import learn_boilerplate
    from retrieval.extract import extract_text

    t0 = time.perf_counter()
    texts: dict[Path, str] = {}
    for p in sorted(folder.rglob("*.html")):
        try:
            texts[p] = extract_text(p.read_bytes(), "html")
        except InvalidInput:
            continue
    learned = learn_boilerplate(texts.values())
    return {"texts": texts, "learned": learned, "pages": len(texts), "s": time.perf_counter() - t0}


def run_set(folder: Path, fns: dict[str, Callable[[bytes], str]], limit: int | None) -> dict[str, Any]:
    """Score every extractor on the pages of ``folder`` (interleaved page by page)."""
    pages = sorted(folder.rglob("*.html"))
    if limit and len(pages) > limit:
        step = len(pages) / limit
        pages = [pages[int(i * step)] for i in range(limit)]
    learn: dict[str, Any] | None = None
    if "ragbudget" in fns:
        from retrieval.boilerplate import drop_boilerplate
        from retrieval.extract import extract_text

        learn = learn_folder(folder)
        known = frozenset(learn["learned"])
        fns = {**fns, "ragbudget": lambda raw: drop_boilerplate(extract_text(raw, "html"), known)[0]}
    tot = {n: {"chrome_kept": 0, "chars": 0, "code": 0, "code_ok": 0, "rows": 0, "rows_ok": 0, "s": 0.0,
               "errors": 0} for n in fns}
    for p in pages:
        raw = p.read_bytes()
        facts = page_facts(raw)
        for name, fn in fns.items():
            t0 = time.perf_counter()
            try:
                text = fn(raw)
            except Exception:  # an extractor failing on a page is a result, not a crash
                tot[name]["errors"] += 1
                continue
            tot[name]["s"] += time.perf_counter() - t0
            for k, v in score(facts, text).items():
                tot[name][k] += v
    out = {}
    for name, t in tot.items():
        out[name] = {"pages": len(pages), "boilerplate_share": t["chrome_kept"] / max(t["chars"], 1),
                     "code_blocks": t["code"], "code_intact": t["code_ok"] / max(t["code"], 1),
                     "table_rows": t["rows"], "rows_intact": t["rows_ok"] / max(t["rows"], 1),
                     "ms_per_page": 1000 * t["s"] / max(len(pages), 1), "errors": t["errors"]}
    if learn is not None:
        out["ragbudget"]["learning_pass"] = {
            "pages": learn["pages"], "s": learn["s"],
            "blocks": [b.text for b in learn["learned"].values()]}
    return out


# --- --diff: what a re-ingest after an extraction change re-versions ----------------------------------

def _baseline_module(rev: str, tmp: Path) -> Any:
    """``retrieval.extract`` as of ``rev`` (with the foundation modules it imports), from ``git show``."""
    for rel in ("retrieval/__init__.py", "retrieval/extract.py", "foundation/__init__.py",
                "foundation/hashing.py", "foundation/errors.py"):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{rel}"],
                                               capture_output=True, check=True).stdout)
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("retrieval", "foundation")}
    for k in saved:
        del sys.modules[k]
    try:
        for package in ("foundation", "retrieval"):  # rooted in tmp: submodules load from there
            spec = importlib.util.spec_from_file_location(
                package, tmp / package / "__init__.py", submodule_search_locations=[str(tmp / package)])
            assert spec is not None and spec.loader is not None
            sys.modules[package] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[package])
        return importlib.import_module("retrieval.extract")
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] in ("retrieval", "foundation")]:
            del sys.modules[k]
        sys.modules.update(saved)


def diff(folder: Path, rev: str) -> dict[str, Any]:
    """Pages whose stored text differs between ``rev`` and the working tree, and why."""
    from foundation.hashing import normalize_text
    from retrieval.boilerplate import drop_boilerplate

    with tempfile.TemporaryDirectory() as tmp:
        old = _baseline_module(rev, Path(tmp))
        learn = learn_folder(folder)
        known = frozenset(learn["learned"])
        pages = sorted(learn["texts"])
        changed, structural, invisible, nbsp, dropped = [], [], 0, 0, 0
        for p in pages:
            raw = p.read_bytes()
            a, b = old.extract_text(raw, "html"), learn["texts"][p]
            b, removed = drop_boilerplate(b, known)
            dropped += bool(removed)
            if a == b:
                continue
            changed.append(p.name)
            invisible += any(c in a for c in "\u200b\u200c\u2060\ufeff\u00ad")
            nbsp += any(c in a for c in "\u00a0\u202f\u2007")
            if normalize_text(a) != b:
                structural.append(p.name)
    return {"pages": len(pages), "changed": len(changed), "with_no_break_spaces": nbsp,
            "with_invisible_characters": invisible, "extraction_changed": len(structural),
            "boilerplate_blocks_learned": [b.text for b in learn["learned"].values()],
            "pages_with_boilerplate_dropped": dropped, "examples": structural[:10]}


def main() -> int:
    """Run the sets (or ``--diff``) and print the table or JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="*", type=Path)
    ap.add_argument("--extractors", default="ragbudget,html2text,inscriptis,markdownify")
    ap.add_argument("--limit", type=int, default=None, help="pages per set (evenly spread)")
    ap.add_argument("--diff", type=Path, default=None, help="re-ingest diff for this folder")
    ap.add_argument("--baseline-rev", default="main")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    load_before = os.getloadavg()
    if args.diff:
        result: dict[str, Any] = {"diff": diff(args.diff, args.baseline_rev)}
    else:
        fns = extractors(args.extractors.split(","))
        result = {"sets": {str(d): run_set(d, fns, args.limit) for d in args.dirs}}
    result.update({"cpu": cpu_model(), "load_before": load_before, "load_after": os.getloadavg()})
    if args.json or args.diff:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['cpu']}; load average before {load_before[0]:.2f}, after {result['load_after'][0]:.2f}")
    for d, per in result["sets"].items():
        if "ragbudget" in per and "learning_pass" in per["ragbudget"]:
            lp = per["ragbudget"]["learning_pass"]
            print(f"{Path(d).name}: learning pass over {lp['pages']} pages in {lp['s']:.1f} s, "
                  f"{len(lp['blocks'])} boilerplate blocks: {lp['blocks']}")
    print(f"{'set':42} {'extractor':12} {'pages':>5} {'boilerplate':>11} {'code intact':>14} "
          f"{'rows intact':>16} {'ms/page':>8}")
    for d, per in result["sets"].items():
        for name, r in per.items():
            print(f"{Path(d).name[:42]:42} {name:12} {r['pages']:>5} {100 * r['boilerplate_share']:>10.1f}% "
                  f"{100 * r['code_intact']:>7.1f}% /{r['code_blocks']:>5} "
                  f"{100 * r['rows_intact']:>7.1f}% /{r['table_rows']:>6} {r['ms_per_page']:>8.1f}"
                  + (f"  ({r['errors']} errors)" if r["errors"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
