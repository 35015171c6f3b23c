"""The documentation: docs/index.md links every page of docs/; every name SPEC.md gives as
implementing a section exists in ``src/attngeom`` (read statically); every name the README and the
pages import or cite (``from attngeom.x import y``, ``attngeom.x.y``) imports; every cross-reference
in a docstring (``:func:`...```) resolves; the published kvtasks tables, and the verdict rows
the README and docs/kvcache.md copy from them, are what ``tools/kvtasks_tables.py`` prints from the
published data; and the site (``mkdocs.yml``:
the pages in ``docs/`` and an API reference generated from the docstrings by ``mkdocs_hooks.py``)
builds with ``mkdocs build --strict`` and prints no warning. The site test is skipped, with the install command as the reason, where the
``docs`` extra is not installed (``pip install -e '.[docs]'``; ``make`` installs it)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MISSING = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
           if importlib.util.find_spec(m.split(".")[0]) is None
           or (m == "mkdocstrings_handlers.python" and importlib.util.find_spec(m) is None)]

needs_mkdocs = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}: pip install -e '.[docs]'")
SRC = ROOT / "src"


def _module_file(dotted: str) -> Path | None:
    base = SRC.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _defined(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Names bound at the top of a module or class body: functions, classes, assignments, imports."""
    out: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update({t.id: node for t in targets if isinstance(t, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    return out


def _missing(dotted: str) -> str | None:
    """None when ``dotted`` (a module, or a module then a name, then a member of a class) exists."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is None:
            continue
        scope = ast.parse(path.read_text(encoding="utf-8")).body
        for name in parts[cut:]:
            node = _defined(scope).get(name)
            if node is None:
                return f"{dotted}: no {name!r} in {path.relative_to(ROOT)}"
            scope = node.body if isinstance(node, ast.ClassDef) else []
        return None
    return f"{dotted}: no such module"


def test_spec_names_the_code_of_every_section():
    spec = (ROOT / "docs" / "SPEC.md").read_text(encoding="utf-8")
    sections = re.split(r"\n## ", spec)[1:]
    assert len(sections) >= 6
    for section in sections:
        title = section.splitlines()[0]
        assert "*Implemented in:*" in section, f"SPEC section {title!r} does not say what implements it"
    names = re.findall(r"`(attngeom(?:\.\w+)*)`", spec)
    assert len(names) > 30
    problems = [p for p in map(_missing, sorted(set(names))) if p]
    assert not problems, "SPEC.md names code that does not exist:\n" + "\n".join(problems)


FROM_IMPORT = re.compile(r"from (attngeom(?:\.\w+)*) import (\([\w, \n]+\)|[\w, ]+)")
DOTTED = re.compile(r"(?<![\w/.-])attngeom(?:\.\w+)+(?![\w/-]|\.md)")


def _cited(text: str) -> set[str]:
    """The dotted names a page imports (``from attngeom.x import a, b``) or cites (``attngeom.x.y``)."""
    names = {m.group(0) for m in DOTTED.finditer(text)}
    for m in FROM_IMPORT.finditer(text):
        for name in m.group(2).strip("()").replace("\n", " ").split(","):
            if name.strip():
                names.add(f"{m.group(1)}.{name.split(' as ')[0].strip()}")
    return names


def _hooks():
    """mkdocs_hooks.py, the site's hook module: it resolves names the way the strict build does."""
    sys.path.insert(0, str(ROOT))
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(str(ROOT))
    return mkdocs_hooks


@needs_mkdocs
def test_every_name_the_readme_and_the_pages_cite_imports():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    cited = {(p.relative_to(ROOT).as_posix(), n) for p in pages for n in _cited(p.read_text(encoding="utf-8"))}
    assert len(cited) > 100 and ("README.md", "attngeom.traces.diff") in cited
    exists = _hooks().exists
    broken = sorted(f"{page}: {name}" for page, name in cited if not exists(name))
    assert not broken, "documented names that do not import:\n" + "\n".join(broken)


@needs_mkdocs
def test_plotting_api_is_public_and_the_other_report_writers_internal():
    """The API reference has a page for the plotting API the README uses (attngeom.reports.plot);
    the other report writers are listed under Internals, the command line not at all."""
    hooks = _hooks()
    documented = hooks.modules()
    assert "attngeom.reports.plot" in documented and hooks.is_public("attngeom.reports.plot")
    reports = [m for m in documented if m.startswith("attngeom.reports")]
    assert "attngeom.reports" in reports and "attngeom.reports.claims" in reports
    assert [m for m in reports if hooks.is_public(m)] == ["attngeom.reports.plot"]
    assert hooks.is_public("attngeom.sinks") and not hooks.is_public("attngeom.sinks.experiment")
    assert not any(m.startswith(("attngeom.cli", "attngeom.commands")) for m in documented)


@needs_mkdocs
def test_every_cross_reference_in_a_docstring_resolves():
    hooks = _hooks()
    plugin = ["attngeom.capture.session"]
    assert hooks.unresolved("Session.run", plugin, "attngeom.capture")          # no such method
    assert not hooks.unresolved("Session.active", plugin, "attngeom.capture")
    assert not hooks.unresolved(".formulas", ["attngeom.metrics"], "attngeom.metrics")
    assert hooks.unresolved(".nothing", ["attngeom.metrics"], "attngeom.metrics")
    assert not hooks.unresolved("attngeom.runs.run.Run.finish", ["attngeom.commands.common"], "attngeom.commands")
    broken = hooks.broken_references()
    assert not broken, "\n".join(broken)


def _build(tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _links(page: str) -> set[str]:
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    return set(re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", text))


@needs_mkdocs
def test_the_checkout_reference_is_current():
    """docs/reference.md, the API reference a checkout shows without a build, lists every public name
    of every public package with the file that defines it: exactly what mkdocs_hooks prints now, and
    every file it names exists."""
    hooks = _hooks()
    page = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    assert page == hooks.checkout_reference(), ("docs/reference.md is stale: python -c \"import mkdocs_hooks; "
                                                "print(mkdocs_hooks.checkout_reference(), end='')\" > docs/reference.md")
    files = set(re.findall(r"`(src/attngeom/[\w/]+\.py)`", page))
    assert len(files) > 20 and all((ROOT / f).is_file() for f in files)
    assert "| `analyze` | `src/attngeom/traces/trace.py` |" in page and "## `attngeom.reports.plot`" in page


def test_index_maps_every_page():
    """Every page of docs/ is linked from docs/index.md; a run's report or tables
    (``claims-runs/*/claims.md``, ``kvtasks-runs/*/*.md``) may be linked from the findings page
    that cites it instead."""
    linked = _links("index.md")
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")} - {"index.md"}
    cited = {"claims-runs/": _links("findings-claims.md"), "kvtasks-runs/": _links("kvcache.md")}
    unlinked = {p for p in pages - linked if not any(p.startswith(d) and p in c for d, c in cited.items())}
    assert not unlinked, f"docs/index.md does not link {sorted(unlinked)}"
    assert not linked - pages - {p for p in linked if p.startswith("api/")}, "docs/index.md links pages that do not exist"


@needs_mkdocs
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
    metrics = (site / "api" / "attngeom.metrics.formulas" / "index.html").read_text(encoding="utf-8")
    assert "Token-importance metrics" in metrics and "contribution_from" in metrics
    assert ":func:" not in metrics and ":mod:" not in metrics   # Sphinx roles turned into code spans
    assert (site / "api" / "attngeom.metrics.registry" / "index.html").is_file()
    # The public API (attngeom and each package, with the table of its public names) and the
    # internals (each submodule) are two sections of the navigation.
    index = (site / "index.html").read_text(encoding="utf-8")
    assert "API reference" in index and "Internals" in index
    sinks = (site / "api" / "attngeom.sinks" / "index.html").read_text(encoding="utf-8")
    assert "Public names" in sinks
    assert 'href="../attngeom.sinks.reducer/#attngeom.sinks.reducer.SinkStats"' in sinks


def _verdict_rows(md: str) -> list[list[str]]:
    """The body rows (cells) of every table of ``md`` whose header names the best geometry policy,
    written as the tool writes them: ASCII minus, names in lower case, the verdict without a gloss."""
    rows, inside = [], False
    for line in md.splitlines():
        if not line.startswith("|"):
            inside = False
            continue
        if "best geometry policy" in line:
            inside = True
            continue
        if inside and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append([re.sub(r"\((tie|loses|wins)[^)]*\)", r"(\1)", c.replace("−", "-").lower()) for c in cells])
    return rows


def test_the_published_kvtasks_tables_are_their_runs_tables():
    """Each folder of docs/kvtasks-runs holds the tables ``tools/kvtasks_tables.py`` prints from its
    data and the accuracy figure, and every row of the verdict tables in the README and docs/kvcache.md is a row that tool
    prints (``--readme``) for a published run: a number in the prose tables cannot go stale when a
    sample grows. The README's rows are checked against the run their first cell names (of the
    runs of that model, length, mode and haystack -- the noise unless the cell names RULER's --,
    the largest: the merged sample)."""
    from contextlib import redirect_stdout
    from io import StringIO

    from checks import load_script

    tables = load_script(ROOT / "tools" / "kvtasks_tables.py")
    anywhere: set[tuple] = set()
    printed: dict[tuple, tuple[int, set[tuple]]] = {}        # (model, length, mode) -> (examples, rows)
    for run in sorted((ROOT / "docs" / "kvtasks-runs").glob("*/summary.json")):
        out = StringIO()
        with redirect_stdout(out):
            assert tables.main([str(run.parent)]) == 0
        assert (run.parent / "tables.md").read_text(encoding="utf-8") == out.getvalue(), \
            f"{run.parent.name}/tables.md is not tools/kvtasks_tables.py {run.parent.name}"
        assert (run.parent / "kvtasks-accuracy.png").is_file(), \
            f"{run.parent.name} has no figure (the command and tools/kvtasks_merge.py draw kvtasks-accuracy.png)"
        s, pairs = tables.load(run.parent)
        haystack = "noise" if s["settings"]["haystack"] == "noise" else "ruler's haystacks"
        key = (s["model"], s["length"], s["mode"], haystack)
        rows = {tuple(r) for r in _verdict_rows(tables.readme_table(s, pairs))}
        anywhere |= rows
        if s["examples"] > printed.get(key, (0, set()))[0]:
            printed[key] = (s["examples"], rows)
    readme = _verdict_rows((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(readme) >= 8
    for row in readme:
        size, mode, *haystack = (c.strip() for c in row[0].split(","))
        key = ("SmolLM2-135M-Instruct", int(size.rstrip("k")) * 1024, mode, haystack[0] if haystack else "noise")
        assert tuple(row[1:]) in printed.get(key, (0, set()))[1], f"README row {row} is not in the tables of {key}"
    kvcache = _verdict_rows((ROOT / "docs" / "kvcache.md").read_text(encoding="utf-8"))
    assert len(kvcache) >= 12
    for row in kvcache:
        assert tuple(row[-5:]) in anywhere, f"docs/kvcache.md row {row} is not in any published run's tables"
