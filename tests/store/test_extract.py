from __future__ import annotations

import pytest

from foundation.errors import EmptyContent, InvalidEncoding, UnsupportedType
from retrieval.extract import extract_text, has_visible_content, html_to_text, kind_for_suffix
from tests.conftest import CASES

PAGE = """<?xml version="1.0" encoding="UTF-8" standalone="no"?>
<!DOCTYPE html><html xmlns="http://www.w3.org/1999/xhtml"><head><title>SELECT</title>
<style>body {{ color: red }}</style></head><body id="docContent" class="{cls}">
<div class="navheader"><table><tr><th>SELECT</th></tr><tr><td><a href="index.html"
title="PostgreSQL {release} Documentation">Home</a></td></tr></table><hr /></div>
<div class="refentry" id="{anchor}"><h2><span class="refentrytitle">SELECT</span></h2>
<p>SELECT, TABLE, WITH &mdash; retrieve   rows
   from a <code class="literal">table</code>.</p>
<pre class="synopsis">
SELECT [ ALL | DISTINCT ]
    [ FROM from_item ]
</pre>
<ul><li><p>first item</p></li><li>second item</li></ul>
<table><tr><th>Limit</th><th>Value</th></tr><tr><td>columns</td><td>1600</td></tr></table>
<script>alert("x")</script></div>
<div class="navfooter"><hr /><a title="PostgreSQL {release} Documentation">Home</a></div>
</body></html>"""


def page(release: str = "15.18", anchor: str = "SQL-SELECT", cls: str = "container") -> bytes:
    return PAGE.format(release=release, anchor=anchor, cls=cls).encode()


def test_html_text_drops_navigation_header_and_footer_with_the_release_number():
    text = html_to_text(page())
    assert "15.18" not in text and "Home" not in text
    assert text.startswith("SELECT\n\nSELECT, TABLE, WITH — retrieve rows from a table.")


def test_markup_and_release_only_differences_give_identical_text():
    a = extract_text(page("15.18", "SQL-SELECT", "container"), "html")
    b = extract_text(page("15.20", "id-1.9.3.172", "container-fluid col-10"), "html")
    assert a == b


def test_html_keeps_preformatted_blocks_verbatim_and_drops_scripts_and_styles():
    text = html_to_text(page())
    assert "SELECT [ ALL | DISTINCT ]\n    [ FROM from_item ]" in text
    assert "alert" not in text and "color" not in text


def test_html_lists_and_tables_stay_readable():
    text = html_to_text(page())
    assert "- first item" in text and "- second item" in text
    assert "Limit | Value" in text and "columns | 1600" in text


def test_invalid_utf8_is_rejected_with_the_byte_offset():
    with pytest.raises(InvalidEncoding) as exc:
        extract_text(b"caf\xe9 au lait", "txt")
    assert exc.value.details["offset"] == 3


def test_binary_content_is_rejected():
    with pytest.raises(InvalidEncoding, match="binary"):
        extract_text(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "txt")


@pytest.mark.parametrize("name", ["empty.txt", "whitespace_only.txt", "invisible_only.txt"])
def test_no_visible_content_is_rejected(name):
    raw = (CASES / name).read_bytes()
    assert not has_visible_content(raw.decode("utf-8-sig"))
    with pytest.raises(EmptyContent):
        extract_text(raw, "txt")


def test_html_without_visible_body_text_is_rejected():
    with pytest.raises(EmptyContent):
        extract_text(b"<html><head><title>t</title></head><body><script>x()</script></body></html>", "html")


@pytest.mark.parametrize(("name", "kind"), [("a.txt", "txt"), ("b.MD", "md"), ("c.rst", "rst"),
                                            ("d.html", "html"), ("e.HTM", "html")])
def test_supported_suffixes_map_to_kinds(name, kind):
    assert kind_for_suffix(name) == kind


@pytest.mark.parametrize("name", ["report.pdf", "Makefile", "image.png"])
def test_unsupported_suffixes_are_rejected(name):
    with pytest.raises(UnsupportedType):
        kind_for_suffix(name)


def test_text_is_nfc_normalised_and_newlines_unified():
    assert extract_text("e\u0301\r\nx\ry".encode(), "txt") == "\u00e9\nx\ny"


# --- structure and main content (shared cases and variations of each kind) ---------------------------

def test_pre_lines_separated_only_by_br_stay_on_their_own_lines():
    text = html_to_text((CASES / "ingest" / "pre_with_br_lines.html").read_bytes())
    assert "wal_level = replica\narchive_mode = on\narchive_command = 'cp %p /mnt/archive/%f'" in text
    nested = html_to_text(b"<pre><code><span>a = 1</span><br/><span>b = 2</span><br><br>c</code></pre>")
    assert nested == "a = 1\nb = 2\n\nc"


def test_site_chrome_around_main_is_dropped_and_the_main_content_kept():
    text = html_to_text((CASES / "ingest" / "site_chrome_around_main.html").read_bytes())
    assert text == ("Backup and restore\n\n"
                    "Run exampledb-dump --format=custom nightly and keep seven copies.")


@pytest.mark.parametrize("chrome", [
    '<div role="navigation"><a href="/">Home</a> <a href="/x">Menu entry</a></div>',
    '<div role="banner">ExampleDB Docs</div>',
    '<div role="contentinfo">Copyright 2026 Example Corp.</div>',
    '<aside>Related pages: a, b, c</aside>',
    '<nav><ul><li>Installation</li></ul></nav>',
    '<header>Site header</header>', '<footer>Site footer</footer>',
])
def test_chrome_by_tag_or_aria_role_is_dropped_without_a_main_element(chrome):
    text = html_to_text(f"<body>{chrome}<div><p>Keep seven copies.</p></div></body>".encode())
    assert text == "Keep seven copies."


def test_a_header_inside_an_article_is_content():
    html = b"<body><article><header><h1>Backups</h1></header><p>Keep seven copies.</p></article></body>"
    assert html_to_text(html) == "Backups\n\nKeep seven copies."


def test_sphinx_permalink_pilcrows_are_dropped_and_role_main_selects_the_body():
    text = html_to_text((CASES / "ingest" / "sphinx_headerlinks.html").read_bytes())
    assert text == "Configuration\n\ncache_size\n\nMaximum cache size in megabytes. Default: 256."


def test_table_cells_holding_paragraphs_keep_their_rows():
    html = b"""<table><thead><tr><th><p>Column Type</p><p>Description</p></th></tr></thead><tbody>
    <tr><td><p><code>oid</code> <code>oid</code></p><p>Row identifier</p></td><td>yes</td></tr>
    <tr><td><p><code>amname</code> <code>name</code></p><ul><li>Name of the</li><li>access method</li></ul>
    </td><td><pre>no</pre></td></tr></tbody></table>"""
    assert html_to_text(html).split("\n\n") == ["Column Type Description", "oid oid Row identifier | yes",
                                                "amname name Name of the access method | no"]
