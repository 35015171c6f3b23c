"""Reports: Markdown escaping of every user-provided string and table cell (the figures:
tests/integration/test_figures.py)."""

import pytest

from attngeom.reports import analyze as rep
from attngeom.reports import markdown as md

NASTY = ["a|b\r<script>alert(1)</script>", "<|im_start|>", "x<img src=x onerror=alert(1)>", "`code`", "``",
         "line\nbreak", "\t*em* _u_ [l](http://e) ![i](x) &amp; ~~s~~ $x$ \\", " lead", "trail ", "\u2028\x1b"]


def render(markdown: str) -> str:
    mdit = pytest.importorskip("markdown_it")
    return mdit.MarkdownIt("commonmark", {"html": True}).enable("table").render(markdown)


def cells(html: str) -> list[list[str]]:
    """The table rows of rendered HTML, each as its cells' inner HTML."""
    import re

    rows = re.findall(r"<tr>(.*?)</tr>", html, re.S)
    return [re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", r, re.S) for r in rows]


def unescape(s: str) -> str:
    import html

    return html.unescape(s)


@pytest.mark.parametrize("s", NASTY)
def test_text_is_inert_and_literal(s):
    out = md.text(s)
    assert "\n" not in out and "\r" not in out
    html = render(f"before {out} after")
    assert "<script" not in html and "<img" not in html and "<a " not in html
    assert "<em>" not in html and "<code>" not in html and "<s>" not in html and "<del>" not in html
    shown = unescape(html.removeprefix("<p>before ").removesuffix(" after</p>\n"))
    expected = (s.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
                .replace("\u2028", "\\u2028").replace("\x1b", "\\x1b"))
    assert shown == expected


def test_token_cell_with_pipe_cr_and_script_stays_one_inert_cell():
    tok = "a|b\r<script>"
    lines = md.table(["rank", "token", "score"], [[1, md.Raw(md.token(tok) + " @3"), "0.5"],
                                                   [2, md.Raw(md.token(" the")), "0.25"]], align="rlr")
    assert len(lines) == 4
    html = render("\n".join(lines))
    rows = cells(html)
    assert [len(r) for r in rows] == [3, 3, 3]
    assert unescape(rows[1][1]) == "a|b\\r<script> @3"
    assert unescape(rows[2][1]) == "␣the"
    assert "<script" not in html


def summary(source="x<img src=x onerror=alert(1)>", tokens=("<|im_start|>", "a|b\r<script>", "`", "\n", " the")):
    top = [{"token": t, "position": i, "score": 0.1 * (5 - i)} for i, t in enumerate(tokens)]
    return {
        "model": {"name": "m|n<b>", "spec": "dir/`spec`", "architecture": "llama", "layers": 2, "heads": 4,
                  "kv_heads": 2, "dtype": "float32", "device": "cpu"},
        "input": {"source": source, "tokens": 12, "windows": 1, "window": None, "stride": None},
        "layers": [0, 1], "maps": "drawn for layers [0, 1]", "attngeom_version": "0.1.0",
        "runtime_s": {"total": 1.0}, "mean_sink_attention": 0.5, "mean_sink_contribution": 0.25,
        "per_layer": [{"layer": 0, "sink_attention": 0.5, "sink_contribution": 0.2,
                       "sink_contribution_to_layer_output": 0.1}],
        "top_tokens": {"layer": 1, "ranked_over": "positions seen by at least 2 queries",
                       "by_contribution_received": top, "by_attention_received": top[::-1]},
        "files": ["tokens.parquet", "maps_layer0.png", "x<img>|.png"],
    }


def test_report_markdown_escapes_every_user_string():
    text = rep.report_markdown(summary())
    html = render(text)
    assert "<img" not in html and "<script" not in html and "<b>" not in html and "<code>" not in html
    assert "x&lt;img src=x onerror=alert(1)&gt;" in html            # the file name, shown literally
    rows = cells(html)
    widths = [len(r) for r in rows]
    assert widths == [4, 4] + [5] * 6, widths                       # per-layer table, then the top tokens
    top = rows[3:]
    assert unescape(top[0][1]) == "<|im_start|> @0"
    assert unescape(top[1][1]) == "a|b\\r<script> @1"
    assert unescape(top[3][1]) == "\\n @3"
    assert unescape(top[4][1]) == "␣the @4"
    # every line of a table is one row: nothing broke a line
    for line in text.splitlines():
        if line.startswith("|"):
            assert line.endswith("|")
    assert 'href="x%3Cimg%3E%7C.png"' in html
