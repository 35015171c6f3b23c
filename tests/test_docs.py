"""The documentation site (``mkdocs.yml``: the pages in ``docs/`` and an API reference generated from
the docstrings by ``mkdocs_hooks.py``) builds with ``mkdocs build --strict`` and prints no warning.

Skipped, with the install command as the reason, where the ``docs`` extra is not installed
(``pip install -e '.[docs]'``; ``make`` installs it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MISSING = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
           if importlib.util.find_spec(m.split(".")[0]) is None
           or (m == "mkdocstrings_handlers.python" and importlib.util.find_spec(m) is None)]

pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}: pip install -e '.[docs]'")


def _build(tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_site_builds_without_warnings(tmp_path):
    done = _build(tmp_path)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    warnings = [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line]
    assert not warnings, "\n".join(warnings)
    site = tmp_path / "site"
    # Every page of docs/ is on the site, and every public module has its API page with its docstring.
    for md in (ROOT / "docs").rglob("*.md"):
        rel = md.relative_to(ROOT / "docs").with_suffix("")
        html = site / ("index.html" if rel.name == "index" else rel / "index.html")
        assert html.is_file(), f"docs/{md.relative_to(ROOT / 'docs')} is missing from the site"
    metrics = (site / "api" / "attngeom.metrics" / "index.html").read_text(encoding="utf-8")
    assert "Token-importance metrics" in metrics and "contribution_from" in metrics
    assert ":func:" not in metrics and ":mod:" not in metrics   # Sphinx roles turned into code spans
    assert (site / "api" / "attngeom.registry" / "index.html").is_file()
