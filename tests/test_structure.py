"""The placement rule: core modules never import the command line or the presentation layer.

Core is every module of ``attngeom`` outside ``commands/``, ``reports/``, ``cli.py`` and
``__main__.py``. The one exception is documented and checked here: ``Trace.to_html`` and
``Trace._repr_html_`` (the explorer's entry points on a trace) import ``attngeom.reports.explore``
lazily, inside the methods."""

from __future__ import annotations

import ast
from pathlib import Path

import attngeom

PKG = Path(attngeom.__file__).parent
PRESENTATION_ENTRY_POINTS = {("trace.py", "to_html"), ("trace.py", "_repr_html_")}


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


def test_explore_defaults_of_the_command_match_the_core():
    """The command keeps its defaults light (no torch at --help); they must equal the core's."""
    from attngeom import explore
    from attngeom.commands import explore as cmd

    assert (cmd.DEFAULT_TOP_K, cmd.DEFAULT_EXACT_MAX_TOKENS) == (explore.DEFAULT_TOP_K, explore.DEFAULT_EXACT_MAX_TOKENS)


def test_trace_is_in_no_import_cycle():
    """Static import graph of the package (module-level and function-level imports alike): no cycle
    passes through attngeom.trace (the explorer, saved traces, forward passes and runner stages
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

    assert "attngeom.explore" in graph["attngeom.trace"] or reaches("attngeom.trace", "attngeom.explore")
    back = [m for m in graph["attngeom.trace"] if reaches(m, "attngeom.trace")]
    assert not back, back
