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


COMMAND_FORBIDDEN = {
    "runs the model itself": ("token_nll(", "batch_nll(", "make_batches(", "Session(", "stream(", "cached_forward(",
                              ".model(", "forward(", "analyze(", "generate(", "stream_generation",
                              "handle.encode(", ".tokenizer(", "to_ids("),
    "runs a stage of an experiment itself": ("reduce_stage(", "taxonomy_stage(", "summaries(", ".stage(",
                                             "TaxonomyStats(", "Stats(", "Reducer"),
    "writes a file by hand instead of through common.Outputs": ("write_parquet(", "write_json(", "write_text(",
                                                                 "to_parquet(", "open("),
}
"""What a command module never does (by the calls it would make): it parses options, checks them,
makes one call into the core and writes through :class:`attngeom.commands.common.Outputs`."""


def test_commands_are_thin_modules():
    """A command module parses, checks, calls the core once and writes through one helper: none holds
    a forward pass, a stage of an experiment or a file written by hand (common.py, the helper itself,
    writes)."""
    for p in sorted((PKG / "commands").glob("*.py")):
        src = p.read_text(encoding="utf-8")
        for what, calls in COMMAND_FORBIDDEN.items():
            if p.name == "common.py" and what.startswith("writes"):
                continue
            for forbidden in calls:
                assert forbidden not in src, f"{p.name} {what} ({forbidden})"


def test_explore_defaults_are_said_once():
    """The explorer's defaults live in its light settings module (no torch at --help); the core's
    constants are those fields."""
    from attngeom.explorer import data as explore
    from attngeom.explorer.settings import ExploreSettings

    d = ExploreSettings()
    assert (explore.DEFAULT_TOP_K, explore.DEFAULT_EXACT_MAX_TOKENS) == (d.top_k, d.exact_max_tokens) == (8, 512)


def _import_graph() -> dict[str, set[str]]:
    """Static import graph of the package: ``{module: modules it imports}``, from every import
    statement of each module (module level, inside functions, and for type checkers alike: a
    dependency hidden in a function is still one). ``from P import n`` counts as an import of ``P.n``
    when that is a module, and of ``P`` itself (its ``__init__`` runs first). The top-level facade
    ``attngeom`` is left out: it imports its public names lazily, and no module of the package imports
    from it (:func:`test_no_module_imports_the_top_level_facade`)."""
    root = PKG
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
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(start):
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out




def test_no_module_is_in_an_import_cycle():
    """No two modules of attngeom import each other, directly or through others (every import
    statement counted, those inside functions too: :func:`_import_graph`)."""
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_the_top_level_facade():
    """Every module of the package imports its siblings directly (``from attngeom.sinks.experiment
    import ...``), never through ``attngeom``'s lazy public names; the facade itself, the command line
    and ``__version__`` are the exceptions."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] in ("commands",) or str(rel) in ("__init__.py", "cli.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "attngeom":
                bad += [f"{rel}:{node.lineno} imports {a.name} from attngeom" for a in node.names if a.name != "__version__"]
            elif isinstance(node, ast.Import) and any(a.name == "attngeom" for a in node.names):
                bad.append(f"{rel}:{node.lineno} imports attngeom")
    assert not bad, bad


def test_trace_is_in_no_import_cycle():
    """The trace reaches the explorer (its HTML entry points import it) and nothing it imports
    imports the trace module back (the explorer, saved traces, forward passes and runner stages)."""
    graph = _import_graph()

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
