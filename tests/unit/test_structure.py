"""The placement rule: core modules never import the command line or the presentation layer.

Core is every module of ``attngeom`` outside ``commands/``, ``reports/``, ``cli.py`` and
``__main__.py``. The one exception is documented and checked here: ``Trace.to_html``,
``Trace._repr_html_``, ``Trace.explore`` and ``ExploreData.to_html`` (the explorer's entry points)
import the explorer and ``attngeom.reports.explore`` lazily, inside the methods, and
``Trace.plot_token_map`` imports ``attngeom.reports.plot`` the same way."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import attngeom

PKG = Path(attngeom.__file__).parent
PRESENTATION_ENTRY_POINTS = {("trace.py", "to_html"), ("trace.py", "_repr_html_"), ("trace.py", "explore"), ("data.py", "to_html"),
                             ("trace.py", "plot_token_map")}


def _core_modules():
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG)
        if rel.parts[0] in ("commands", "reports") or rel.name in ("cli.py", "__main__.py"):
            continue
        yield rel, ast.parse(p.read_text(encoding="utf-8"))


def _imported(node) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [("." * node.level) + (node.module or "")]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return []


def test_core_never_imports_commands_cli_or_reports():
    bad = []
    for rel, tree in _core_modules():
        funcs = {}
        for f in ast.walk(tree):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(f):
                    funcs[id(n)] = f.name
        for node in ast.walk(tree):
            for name in _imported(node):
                parts = name.lstrip(".").split(".")
                if {"commands", "cli", "reports"} & set(parts[:2]) or (name.startswith(".") and parts[0] in (
                        "commands", "cli", "reports")):
                    if (rel.name, funcs.get(id(node))) not in PRESENTATION_ENTRY_POINTS:
                        bad.append(f"{rel}:{node.lineno} imports {name}")
    assert not bad, bad


def test_commands_are_thin_modules():
    """A command module parses, opens a run, calls the core and writes: none holds a forward loop."""
    for p in sorted((PKG / "commands").glob("*.py")):
        src = p.read_text(encoding="utf-8")
        for forbidden in ("token_nll(", "batch_nll(", "make_batches(", "Session("):
            assert forbidden not in src, f"{p.name} runs the model itself ({forbidden})"


def test_explore_defaults_are_said_once():
    """The explorer's defaults live in its light settings module (no torch at --help); the core's
    constants are those fields."""
    from attngeom.explorer import data as explore
    from attngeom.explorer.settings import ExploreSettings

    d = ExploreSettings()
    assert (explore.DEFAULT_TOP_K, explore.DEFAULT_EXACT_MAX_TOKENS) == (d.top_k, d.exact_max_tokens) == (8, 512)


def test_trace_is_in_no_import_cycle():
    """Static import graph of the package (module-level and function-level imports alike): no cycle
    passes through attngeom.traces.trace (the explorer, saved traces, forward passes and runner stages
    import nothing that imports the trace module back)."""
    import ast
    from pathlib import Path

    import attngeom

    root = Path(attngeom.__file__).parent
    mods = {".".join(("attngeom",) + p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for p in root.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, ast.ImportFrom):
                base = pkg
                for _ in range(max(n.level - 1, 0)):
                    base = base.rsplit(".", 1)[0]
                target = (f"{base}.{n.module}" if n.module else base) if n.level else (n.module or "")
                deps |= {t for t in [target] + [f"{target}.{a.name}" for a in n.names] if t in mods}
            elif isinstance(n, ast.Import):
                deps |= {a.name for a in n.names if a.name in mods}
        graph[name] = deps - {name, "attngeom"}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
        return False

    assert "attngeom.explorer.data" in graph["attngeom.traces.trace"] or reaches("attngeom.traces.trace", "attngeom.explorer.data")
    back = [m for m in graph["attngeom.traces.trace"] if reaches(m, "attngeom.traces.trace")]
    assert not back, back


DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"

LAYERS = (
    {"errors", "_exports"},
    {"model", "runs", "data", "stats"},
    {"metrics"},
    {"capture"},
    {"streaming"},
    {"generation", "traces"},
    {"analysis", "faithfulness", "sinks", "selection", "heads", "kvcache", "explorer"},
    {"claims"},
    {"reports", "commands", "cli", "__main__", "__init__"},
)
"""The layers of the package, lowest first: a part imports only from its own layer or below (imports
for type checkers only, and the documented presentation entry points, excepted). ``runs``, ``data``
and ``stats`` are the infrastructure every analysis uses; an experiment's settings live beside it."""


def _map_of_design() -> dict[str, set[str]]:
    """docs/design.md's map of src/attngeom/: each folder it names with the modules it names in it."""
    text = DESIGN.read_text(encoding="utf-8")
    block = text[text.index("```\nsrc/attngeom/"):]
    block = block[:block.index("```", 4)]
    parts, current = {}, None
    for line in block.splitlines()[2:]:
        m = re.match(r"^  (\w+)/\s", line)
        if m:
            current = m.group(1)
            parts[current] = set()
        elif not line.startswith("  ") or line.startswith("  Core") or not line.strip():
            current = None if not line.startswith("                 ") else current
        if current is not None:
            parts[current] |= set(re.findall(r"\b(\w+)\.py\b", line))
    return parts


def test_design_map_and_tree_agree():
    """Every subpackage of attngeom is in docs/design.md's map, every folder the map names exists, and
    every module of an analysis or engine package is named there (commands/, reports/ and model/ are
    described as a whole)."""
    described = _map_of_design()
    tree = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert set(described) == tree, (sorted(set(described) - tree), sorted(tree - set(described)))
    for part, named in described.items():
        if part in ("commands", "reports", "model"):
            continue
        modules = {p.stem for p in (PKG / part).glob("*.py")} - {"__init__"}
        assert named == modules, f"{part}/: design.md names {sorted(named)}, the tree holds {sorted(modules)}"


def test_top_level_holds_only_the_entry_points():
    assert {p.name for p in PKG.glob("*.py")} == {"__init__.py", "__main__.py", "_exports.py", "cli.py", "errors.py"}


def _layer_of(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def _type_checking_lines(tree) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for n in node.body:
                lines.update(range(n.lineno, n.end_lineno + 1))
    return lines


def test_layers_import_only_downwards():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        part = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_lines(tree)
        funcs = {}
        for f in ast.walk(tree):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(f):
                    funcs[id(n)] = f.name
        for node in ast.walk(tree):
            if node.lineno in skip if hasattr(node, "lineno") else False:
                continue
            for name in _imported(node):
                bits = name.split(".")
                if bits[0] != "attngeom" or len(bits) < 2 or bits[1] == "__version__":
                    continue
                if (rel.name, funcs.get(id(node))) in PRESENTATION_ENTRY_POINTS:
                    continue
                if _layer_of(bits[1]) > _layer_of(part):
                    bad.append(f"{rel}:{node.lineno} ({part}) imports {name}")
    assert not bad, "\n".join(bad)


def test_packages_export_only_public_names_that_exist():
    """Each package's ``lazy`` dict names public names only (no ``_name``), and each is defined by the
    submodule it names; ``__all__`` is that dict."""
    import importlib

    for init in sorted(PKG.glob("*/__init__.py")):
        package = importlib.import_module(f"attngeom.{init.parent.name}")
        for name in getattr(package, "__all__", []):
            assert not name.startswith("_"), f"{package.__name__} exports the private name {name}"
            assert hasattr(package, name), f"{package.__name__}.{name} is not defined where its __init__ says"
    for name in attngeom.__all__:
        assert not name.startswith("_") or name == "__version__"
        assert hasattr(attngeom, name), name



def test_input_batch_is_exported_under_one_name():
    """The batch of inputs a reducer sees is public as ``InputBatch`` only (its module's alias
    ``Batch`` is not exported)."""
    from attngeom import streaming

    for package in (attngeom, streaming):
        assert "InputBatch" in package.__all__ and "Batch" not in package.__all__
        assert package.InputBatch is streaming.reducers.InputBatch
