"""Boilerplate repeated across one batch's HTML pages: learned, dropped at page edges, stored for later
batches (retrieval/boilerplate.py; rules in docs/store.md "Extraction")."""

from __future__ import annotations

import random

from sqlalchemy import select

from foundation.db import read_session
from retrieval.boilerplate import (
    MIN_PAGES,
    block_key,
    drop_boilerplate,
    learn_boilerplate,
    page_threshold,
    stored_boilerplate,
)
from retrieval.extract import extract_text
from retrieval.models import BoilerplateBlock
from retrieval.store import IngestItem, get_document

# A site header written as plain <div>s with no semantic tag or ARIA role (as the SQLite docs'
# div.nosearch), a page body, and a plain-<div> footer.
SITE = """<!DOCTYPE html><html><head><title>{title}</title></head><body>
<div class="nosearch"><div class="tagline">Small. Fast. Reliable.<br>Choose any three.</div>
<div class="menu"><ul><li><a href="index.html">Home</a></li><li><a href="docs.html">Documentation</a></li>
<li><a href="download.html">Download</a></li></ul></div></div>
<h1>{title}</h1>
<p>{body}</p>
{middle}
<p>Details about {title} that only this page has.</p>
<div class="site-footer">Copyright the authors. This page is part of the project documentation.</div>
</body></html>"""
HEADER = ["Small. Fast. Reliable.\nChoose any three.", "- Home", "- Documentation", "- Download"]
FOOTER = "Copyright the authors. This page is part of the project documentation."


def site_page(i: int, middle: str = "<h2>See also</h2><p>Other pages.</p>") -> bytes:
    return SITE.format(title=f"Topic {i}", body=f"Topic {i} explains feature number {i}.",
                       middle=middle).encode()


def stored_text(engine, document_id: str) -> str:  # type: ignore[no-untyped-def]
    with read_session(engine) as s:
        doc = get_document(s, document_id)
    assert doc.current is not None and doc.current.text is not None
    return doc.current.text


def texts(pages: list[bytes]) -> list[str]:
    return [extract_text(p, "html") for p in pages]


def test_the_threshold_is_five_pages_and_half_the_batch():
    assert MIN_PAGES == 5
    assert [page_threshold(n) for n in (1, 5, 9, 10, 11, 100)] == [5, 5, 5, 5, 6, 50]


def test_header_and_footer_repeated_on_every_page_are_learned_and_dropped():
    pages = texts([site_page(i) for i in range(8)])
    learned = learn_boilerplate(pages)
    expected = sorted([" ".join(h.split()) for h in HEADER] + [FOOTER])
    assert sorted(b.text for b in learned.values()) == expected
    assert all(b.pages == 8 and b.batch_pages == 8 for b in learned.values())
    text, removed = drop_boilerplate(pages[3], frozenset(learned))
    assert removed == set(learned)
    assert text == ("Topic 3\n\nTopic 3 explains feature number 3.\n\nSee also\n\nOther pages.\n\n"
                    "Details about Topic 3 that only this page has.")


def test_a_block_repeated_in_the_middle_of_pages_is_not_learned():
    # "See also" and "Other pages." are on every page but never at its top or bottom.
    learned = learn_boilerplate(texts([site_page(i) for i in range(8)]))
    assert block_key("See also") not in learned and block_key("Other pages.") not in learned


def test_a_known_block_in_the_middle_of_a_page_is_kept():
    page = "Title\n\nSee also\n\nBody."
    assert drop_boilerplate(page, frozenset({block_key("See also") or ""})) == (page, set())


def test_learning_needs_five_pages_and_half_of_the_batch():
    assert learn_boilerplate(texts([site_page(i) for i in range(4)])) == {}
    # Header on 5 of 10 pages (half): learned; on 5 of 11: not (needs 6).
    plain = [f"Plain page {i}\n\nNothing repeated {i}." for i in range(6)]
    site = texts([site_page(i) for i in range(5)])
    assert block_key("- Home") in learn_boilerplate(site + plain[:5])
    assert learn_boilerplate(site + plain) == {}


def test_learning_is_independent_of_page_order():
    pages = texts([site_page(i) for i in range(7)]) + [f"Other {i}\n\n- Home" for i in range(3)]
    first = learn_boilerplate(pages)
    for seed in range(5):
        shuffled = pages[:]
        random.Random(seed).shuffle(shuffled)
        assert learn_boilerplate(shuffled) == first


def test_a_page_made_only_of_boilerplate_is_kept_whole():
    pages = texts([site_page(i) for i in range(6)])
    learned = frozenset(learn_boilerplate(pages))
    only = "\n\n".join(HEADER)
    assert drop_boilerplate(only, learned) == (only, set())


def test_ingest_drops_the_batch_boilerplate_and_stores_it(engine, ingest):
    items = [IngestItem(f"site/topic{i}.html", raw=site_page(i), kind="html") for i in range(6)]
    items.append(IngestItem("notes.txt", text="- Home\n\nA text file keeps every line.", kind="txt"))
    report = ingest(items)
    assert report.counts["added"] == 7
    text = stored_text(engine, "site/topic2.html")
    assert text.startswith("Topic 2\n\n") and text.endswith("only this page has.")
    assert stored_text(engine, "notes.txt").startswith("- Home")  # text files are never touched
    with read_session(engine) as s:
        rows = s.scalars(select(BoilerplateBlock).order_by(BoilerplateBlock.block_hash)).all()
        assert {r.text for r in rows} == {" ".join(h.split()) for h in HEADER} | {FOOTER}
        assert {(r.pages, r.batch_pages, r.revision) for r in rows} == {(6, 6, report.revision)}
        assert len(stored_boilerplate(s)) == 5


def test_a_page_ingested_alone_later_gets_the_same_text_as_in_its_batch(engine, ingest):
    ingest([IngestItem(f"site/topic{i}.html", raw=site_page(i), kind="html") for i in range(6)])
    alone = ingest([IngestItem("site/topic3.html", raw=site_page(3), kind="html")])
    assert alone.revision is None and alone.counts["unchanged"] == 1
    new = ingest([IngestItem("site/topic9.html", raw=site_page(9), kind="html")])
    assert new.counts["added"] == 1
    assert stored_text(engine, "site/topic9.html").startswith("Topic 9\n\n")
    again = ingest([IngestItem(f"site/topic{i}.html", raw=site_page(i), kind="html") for i in range(10)])
    assert again.counts["unchanged"] == 7 and again.counts["added"] == 3


def test_a_batch_without_repeated_blocks_stores_the_text_it_stored_before(engine, ingest):
    # Pages with nothing repeated at their edges: the text is extract_text's, byte for byte.
    pages = [site_page(i).replace(b"nosearch", b"x").replace(b"Choose any three.", f"{i}".encode())
             .replace(b"Copyright the authors.", f"Page {i}.".encode()) for i in range(6)]
    pages = [p.replace(b"<li><a", b"<li>" + str(i).encode() + b"<a") for i, p in enumerate(pages)]
    ingest([IngestItem(f"p{i}.html", raw=p, kind="html") for i, p in enumerate(pages)])
    with read_session(engine) as s:
        assert stored_boilerplate(s) == frozenset()
    for i, p in enumerate(pages):
        assert stored_text(engine, f"p{i}.html") == extract_text(p, "html")
