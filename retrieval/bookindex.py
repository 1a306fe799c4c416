"""A labelled evaluation set from a DocBook back-of-book index (``bookindex.html``).

The PostgreSQL documentation ships ~3000 hand-made index entries, each linking
a term to the page(s) that discuss it. Query = the index term (subterms
prefixed with their parent term), relevant = the linked page file names. Used by
the retrieval-quality benchmark and by ``ragbudget sweep``'s default questions;
it is derived at run time from the fetched corpus, never stored in the repo.
"""

from __future__ import annotations

import warnings
from typing import Any

EXCLUDED_PAGES = {"bookindex.html"}


def parse_bookindex(html: str) -> list[tuple[str, set[str]]]:
    """``[(query, relevant page file names)]`` from a DocBook ``bookindex.html``, in index order.

    Subterms (``dd > dl > dt``) are prefixed with their parent term's text; a
    query seen twice gets the union of its pages; the index page itself is never
    relevant.
    """
    from bs4 import BeautifulSoup, Tag, XMLParsedAsHTMLWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", XMLParsedAsHTMLWarning)
        soup = BeautifulSoup(html, "lxml")
    merged: dict[str, set[str]] = {}

    def term_of(dt: Tag) -> str:
        parts: list[str] = []
        for node in dt.children:
            if isinstance(node, Tag):
                if node.name == "a" or node.name == "dl":
                    break
                parts.append(node.get_text())
            else:
                parts.append(str(node))
        text = " ".join("".join(parts).split())
        return text.rstrip(", ").strip()

    def walk(dl: Tag, prefix: str) -> None:
        for dt in dl.find_all("dt", recursive=False):
            term = term_of(dt)
            query = f"{prefix} {term}".strip() if prefix else term
            pages = {str(a["href"]).split("#", 1)[0] for a in dt.find_all("a", class_="indexterm")
                     if a.get("href")}
            pages -= EXCLUDED_PAGES
            if query and pages:
                merged.setdefault(query, set()).update(pages)
            dd = dt.find_next_sibling()
            if isinstance(dd, Tag) and dd.name == "dd":
                sub = dd.find("dl")
                if isinstance(sub, Tag):
                    walk(sub, query)

    for div in soup.find_all("div", class_="indexdiv"):
        dl = div.find("dl", recursive=False)
        if isinstance(dl, Tag):
            walk(dl, "")
    return [(q, pages) for q, pages in merged.items()]


def page_ranking(hits: list[Any]) -> list[str]:
    """Pages (document ids) in rank order of their best chunk, excluding :data:`EXCLUDED_PAGES`."""
    seen: dict[str, None] = {}
    for h in hits:
        if h.document_id not in EXCLUDED_PAGES:
            seen.setdefault(h.document_id, None)
    return list(seen)
