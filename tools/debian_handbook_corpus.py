#!/usr/bin/env python
"""A second held-out English corpus, reachable offline: the prose of *The Debian Administrator's
Handbook* (Raphaël Hertzog and Roland Mas; Debian package ``debian-handbook`` 11.20220922,
GPL-2.0+ or CC-BY-SA-3.0), English edition.

The package ships the book as HTML. This script takes the ``en-US`` chapters in the order of the
book's table of contents, keeps the text of every paragraph (``<div class="para">``) of at least
12 words, leaves out program listings, screen output and figure captions, and writes one
paragraph per block separated by blank lines (the layout WikiText's raw text has), UTF-8::

    apt-get download debian-handbook        # or: apt-get install debian-handbook
    python tools/debian_handbook_corpus.py debian-handbook_*.deb out/debian-handbook.txt
    python tools/debian_handbook_corpus.py debian-handbook_*.deb prose.txt --start "I'm pleased" --max-bytes 300000 --inline-code

The second writes ``attngeom/kvcache/data/prose.txt``, the essay haystack of ``attngeom kvtasks``:
the paragraphs from the first that begins with ``--start`` on, as many whole ones as fit in
``--max-bytes``, with the names set in ``<code>`` inside sentences kept.
The first argument is the ``.deb`` file or the installed ``/usr/share/doc/debian-handbook/html``.
It is technical English prose (system administration), unlike WikiText's encyclopaedia articles,
which is the point of a second corpus.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

SKIP = {"pre", "script", "style", "code"}
MIN_WORDS = 12


class _Paragraphs(HTMLParser):
    def __init__(self, skip=frozenset(SKIP)):
        super().__init__(convert_charrefs=True)
        self.skipped = skip
        self.stack: list[bool] = []   # per open div: is it a paragraph
        self.skip = 0
        self.buf: list[str] = []
        self.out: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "div":
            is_para = ("class", "para") in attrs and not any(self.stack)
            self.stack.append(is_para)
            if is_para:
                self.buf = []
        elif tag in self.skipped:
            self.skip += 1

    def handle_endtag(self, tag):
        if tag == "div" and self.stack:
            if self.stack.pop():
                text = " ".join("".join(self.buf).split())
                if len(text.split()) >= MIN_WORDS:
                    self.out.append(text)
        elif tag in self.skipped and self.skip:
            self.skip -= 1

    def handle_data(self, data):
        if any(self.stack) and not self.skip:
            self.buf.append(data)


def chapters(html_dir: Path) -> list[Path]:
    """The chapter files in the order the book's index links them."""
    index = (html_dir / "index.html").read_text(encoding="utf-8")
    order: list[str] = []
    for name in re.findall(r'href="([^"#]+\.html)', index):
        if name not in order and (html_dir / name).is_file():
            order.append(name)
    rest = sorted(p.name for p in html_dir.glob("*.html") if p.name not in order and p.name != "index.html")
    return [html_dir / n for n in order + rest]


def corpus(html_dir: Path, start: str = "", max_bytes: int = 0, inline_code: bool = False) -> str:
    """The book's paragraphs, from the first beginning with ``start`` on; with ``max_bytes``, as
    many whole paragraphs as the text holds within that size; ``inline_code`` keeps the names of
    commands, files and packages set in ``<code>`` inside a sentence (otherwise left out, leaving
    gaps such as "Most of 's features")."""
    paras: list[str] = []
    for f in chapters(html_dir):
        p = _Paragraphs(frozenset(SKIP) - ({"code"} if inline_code else set()))
        p.feed(f.read_text(encoding="utf-8"))
        paras += p.out
    paras = paras[next(i for i, p in enumerate(paras) if p.startswith(start)):]
    if max_bytes:
        kept, size = [], 0
        for p in paras:
            size += len(p.encode("utf-8")) + 2
            if size > max_bytes:
                break
            kept.append(p)
        paras = kept
    return "\n\n".join(paras) + "\n"


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="the Debian Administrator's Handbook's English prose")
    ap.add_argument("src", type=Path, help="the debian-handbook .deb or its installed html folder")
    ap.add_argument("out", type=Path)
    ap.add_argument("--start", default="", help="begin at the first paragraph beginning with this text")
    ap.add_argument("--max-bytes", type=int, default=0, help="keep whole paragraphs within this size")
    ap.add_argument("--inline-code", action="store_true", help="keep command and file names set in <code> in sentences")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    src, out = a.src, a.out
    with tempfile.TemporaryDirectory() as tmp:
        if src.suffix == ".deb":
            subprocess.run(["dpkg-deb", "-x", str(src), tmp], check=True)
            src = Path(tmp) / "usr/share/doc/debian-handbook/html"
        text = corpus(src / "en-US", a.start, a.max_bytes, a.inline_code)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"{out}: {len(text.split()):,} words in {text.count(chr(10) * 2) + 1:,} paragraphs")


if __name__ == "__main__":
    main()
