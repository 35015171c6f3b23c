"""Every Python snippet of the README and the docs runs, as written, on the bundled SmolLM2.

The snippets of one page run in order in one namespace (later ones use the ``model`` and ``trace``
of earlier ones), in a temporary folder holding the corpus file the README names (the WikiText
excerpt of tests/data under that name) and ``docs/`` (a link: the published runs a page reads, as in
a checkout). A snippet that fails names its page and its first line."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
EXCERPT = ROOT / "tests" / "data" / "wikitext-2-raw-test-excerpt.txt"


def _snippets(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(encoding="utf-8"), re.S)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if _snippets(p)])
def test_every_snippet_of_the_page_runs(page, tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    shutil.copy(EXCERPT, tmp_path / "wikitext-2-raw-test.txt")
    (tmp_path / "docs").symlink_to(ROOT / "docs")   # snippets that read a published run do so from a checkout's root
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__snippet__"}
    for code in _snippets(page):
        try:
            exec(compile(code, f"{page} snippet", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the failure message is the point
            pytest.fail(f"{page}: the snippet starting {code.splitlines()[0]!r} failed: {type(e).__name__}: {e}",
                        pytrace=False)
