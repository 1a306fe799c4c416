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


# --- encodings: byte-order marks and declared charsets (retrieval/decoding.py) -----------------

TEXT = "Pumpe geprüft: 6 bar, Ventil ✓ — naïve café"


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be", "utf-8"])
@pytest.mark.parametrize("kind", ["txt", "md", "rst"])
def test_a_text_file_with_a_byte_order_mark_is_read_in_its_encoding(codec, kind):
    import codecs

    bom = {"utf-16-le": codecs.BOM_UTF16_LE, "utf-16-be": codecs.BOM_UTF16_BE,
           "utf-32-le": codecs.BOM_UTF32_LE, "utf-32-be": codecs.BOM_UTF32_BE, "utf-8": codecs.BOM_UTF8}
    assert extract_text(bom[codec] + TEXT.encode(codec), kind) == TEXT


def test_an_html_page_in_utf16_with_a_byte_order_mark_is_read():
    html = f"<html><head><meta charset='utf-16'></head><body><p>{TEXT}</p></body></html>"
    assert extract_text(b"\xff\xfe" + html.encode("utf-16-le"), "html") == TEXT


def test_a_utf16_file_without_a_byte_order_mark_is_refused_with_the_reason():
    with pytest.raises(InvalidEncoding, match="byte-order mark") as exc:
        extract_text(TEXT.encode("utf-16-le"), "txt")
    assert exc.value.code == "invalid_encoding"


@pytest.mark.parametrize("head", [
    '<?xml version="1.0" encoding="ISO-8859-1"?>\n<html><head>',
    '<html><head><meta charset="iso-8859-1">',
    '<html><head><meta http-equiv="Content-Type" content="text/html; charset=latin1">',
])
def test_an_html_page_is_read_in_the_charset_it_declares(head):
    raw = (head + "<title>t</title></head><body><p>café crème</p></body></html>").encode("latin-1")
    assert extract_text(raw, "html") == "café crème"


def test_a_windows_1252_page_keeps_its_typographic_quotes():
    raw = b'<html><head><meta charset="windows-1252"></head><body><p>\x93quoted\x94</p></body></html>'
    assert extract_text(raw, "html") == "\u201cquoted\u201d"


@pytest.mark.parametrize(("raw", "kind", "why"), [
    (b"\xff\xfe" + "ok".encode("utf-16-le") + b"\x00\xd8", "txt", "UTF-16-LE, from its byte-order mark"),
    (b'<html><head><meta charset="utf-8"></head><body>caf\xe9</body></html>', "html", "UTF-8"),
    (b"<html><body>caf\xe9, no charset declared</body></html>", "html", "no declared charset"),
    (b'<html><head><meta charset="x-klingon"></head><body>x</body></html>', "html", "x-klingon"),
])
def test_a_file_that_cannot_be_decoded_is_refused_naming_the_encoding(raw, kind, why):
    with pytest.raises(InvalidEncoding, match=why):
        extract_text(raw, kind)


# --- Markdown: front matter as metadata, HTML comments dropped (retrieval/markdown.py) ----------

MD = """---
title: Pump maintenance
tags: [pumps, building-4]
updated: 2024-03-01
deploy_token: tok-FRONTMATTER-7781
---
# Pump maintenance

The pump is inspected every six months. <!-- admin password: hunter2-COMMENT -->

<!--
TODO: rotate the key ssh-COMMENT-9931
-->
```html
<!-- kept: a comment shown as code -->
```

Write `<!-- inline code -->` to hide a line.
"""


def test_markdown_front_matter_is_metadata_and_not_text():
    from retrieval.extract import extract

    got = extract("md", raw=MD.encode())
    assert got.front_matter == {"title": "Pump maintenance", "tags": ["pumps", "building-4"],
                                "updated": "2024-03-01", "deploy_token": "tok-FRONTMATTER-7781"}
    assert got.text.startswith("# Pump maintenance")
    assert "FRONTMATTER" not in got.text and "title:" not in got.text


def test_html_comments_are_dropped_from_markdown_but_not_from_its_code():
    text = extract_text(MD.encode(), "md")
    assert "COMMENT" not in text and "hunter2" not in text
    assert "<!-- kept: a comment shown as code -->" in text and "`<!-- inline code -->`" in text
    assert "The pump is inspected every six months." in text


def test_html_comments_are_dropped_from_html():
    raw = b"<html><body><p>Pump <!-- password: hunter2 -->check</p><pre>a<!-- b -->c</pre></body></html>"
    assert extract_text(raw, "html") == "Pump check\n\nac"


def test_front_matter_that_is_not_valid_yaml_is_refused():
    from foundation.errors import InvalidInput

    with pytest.raises(InvalidInput, match="not valid YAML") as exc:
        extract_text(b"---\ntitle: [unclosed\n---\nBody", "md")
    assert exc.value.code == "invalid_front_matter"


def test_a_thematic_break_and_a_heading_are_not_front_matter():
    from retrieval.extract import extract

    got = extract("md", raw=b"---\nJust a heading\n---\nBody")
    assert got.front_matter is None and got.text == "---\nJust a heading\n---\nBody"


def test_a_yaml_alias_bomb_in_front_matter_is_refused():
    from foundation.errors import TooLarge

    levels = "".join(f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n"
                     for p, n in zip("abcde", "bcdef", strict=True))
    bomb = "---\na: &a [x, x, x, x, x, x, x, x, x, x]\n" + levels + "---\nBody"
    with pytest.raises(TooLarge):
        extract_text(bomb.encode(), "md")
