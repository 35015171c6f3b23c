"""MkDocs hook: the API reference, generated at build time, in two parts.

**API reference** — the public API: one page for ``attngeom`` and one per package
(``attngeom.sinks``, ...). A package names its public names in the dict it hands to
``attngeom._exports.lazy`` (``attngeom``'s own is ``_LAZY``); its page shows the package docstring
and each of those names, documented where it is defined. **Internals** — one page per submodule
(``api/<dotted name>.md``, ``::: attngeom.<name>``), everything the package docstrings point into.
mkdocstrings renders every page from the docstrings, read statically by griffe. A module or a
public name added or removed in ``src/attngeom`` therefore appears or disappears without editing
``mkdocs.yml``. Pages in ``docs/`` that ``mkdocs.yml``'s ``nav`` does not name are listed under
"More", so a new page never breaks the strict build. The command line (``cli``, ``commands``) is
left out: ``attngeom COMMAND --help`` documents it. The report writers (``reports``) are internal to
the commands and listed under Internals, except the plotting API (``attngeom.reports.plot``), a
public module (:data:`PUBLIC_MODULES`) with its own page in the API reference.

:class:`SphinxRoles` is a griffe extension (named in ``mkdocs.yml``): the docstrings use Sphinx roles
(``:func:`name```, ``:class:`~attngeom.x.Y```), which Markdown would show literally; it turns each
into a code span (``name``, ``Y``), and the reStructuredText literal-block marker ``text::`` into
``text:`` (the indented block after it is already a Markdown code block), before mkdocstrings
renders the docstring. Every role's target must resolve (:func:`unresolved`): the build logs a
warning for each one that does not (``mkdocs build --strict`` fails on it), and
tests/integration/test_docs.py checks every docstring of ``src/attngeom`` the same way.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import re
from pathlib import Path

from griffe import Extension
from mkdocs.structure.files import File

ROOT = Path(__file__).parent / "src" / "attngeom"
EXCLUDED = {"cli", "commands"}
INTERNAL_PACKAGES = {"attngeom.reports"}
"""Packages whose page belongs under Internals: they export no public name."""
PUBLIC_MODULES = {"attngeom.reports.plot"}
"""Modules, not packages, that are public API: each gets its page (the whole module) in the API
reference, not under Internals."""
SECTION = "API reference"
INTERNALS = "Internals"


def modules() -> list[str]:
    """Dotted names of the documented modules, package first, then in alphabetical order."""
    names = ["attngeom"]
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or parts[0] in EXCLUDED or any(p.startswith("_") for p in parts):
            continue
        names.append(".".join(["attngeom", *parts]))
    return names


def _is_package(name: str) -> bool:
    return (ROOT.parent.joinpath(*name.split(".")) / "__init__.py").is_file()


def exports(package: str) -> dict[str, str]:
    """A package's public names -> the module that defines each (read statically from the dict its
    ``__init__`` hands to ``lazy``, or ``attngeom``'s ``_LAZY`` and its direct imports)."""
    init = ROOT.parent.joinpath(*package.split(".")) / "__init__.py"
    tree = ast.parse(init.read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attngeom.") \
                and node.level == 0 and not node.module.rsplit(".", 1)[-1].startswith("_"):
            out.update({a.asname or a.name: node.module for a in node.names})
        value = getattr(node, "value", None)
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "lazy":   # ... = lazy(__name__, {...})
            value = next((a for a in value.args if isinstance(a, ast.Dict)), None)
        elif not (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets)):
            value = None                                      # another dict (a registry) names no exports
        if isinstance(value, ast.Dict):
            for key, where in zip(value.keys, value.values):
                sub = f"{package}{where.value}" if where.value.startswith(".") else f"{package}.{where.value}"
                out[key.value] = sub
    for name, where in list(out.items()):       # a name a package re-exports from another package
        if _is_package(where) and where != package:
            out[name] = exports(where).get(name, where)
    return out


def page(name: str) -> str:
    return f"api/{name}.md"


def summary(module: str, name: str) -> str:
    """The first line of the docstring of ``name`` in ``module`` (read statically), or ""."""
    path = ROOT.parent.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    body = ast.parse(path.read_text(encoding="utf-8")).body
    for node, after in zip(body, [*body[1:], None]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            doc = ast.get_docstring(node) or ""
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and name in {
                t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}:
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str) else ""
        else:
            continue
        return ROLE.sub(_role_text, doc.strip().split("\n\n")[0].replace("\n", " ")).replace("|", "\\|")
    return ""


def public_page(name: str) -> str:
    """The public API page of ``attngeom`` or one package: its docstring, then a table of its public
    names, each linked to where it is documented (its module's page under Internals)."""
    lines = [f"# `{name}`", "", f"::: {name}", "    options:", "      members: false", "",
             "## Public names", "", "| name | defined in | |", "|---|---|---|"]
    for public, where in sorted(exports(name).items(), key=lambda kv: kv[0].lower()):
        lines.append(f"| [`{public}`]({where}.md#{where}.{public}) | `{where}` | {summary(where, public)} |")
    return "\n".join(lines) + "\n"


def source_file(module: str) -> str:
    """The file that defines ``module``, relative to the repository root."""
    path = ROOT.parent.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return path.relative_to(ROOT.parent.parent).as_posix()


def checkout_reference() -> str:
    """docs/reference.md: the public API as a checkout shows it (no build): for ``attngeom`` and each
    public package, its public names with the first line of their docstring and the file that defines
    each. tests/integration/test_docs.py checks that the page is what this prints."""
    lines = ["# API reference in a checkout", "",
             "Every public name of attngeom, where it is defined and the first line of its docstring, written by",
             "`python -c \"import mkdocs_hooks; print(mkdocs_hooks.checkout_reference(), end='')\" > docs/reference.md`",
             "(the documentation site, `make docs`, renders the full docstrings of every module).", ""]
    for name in modules():
        if not is_public(name):
            continue
        lines += [f"## `{name}`", ""]
        if not _is_package(name):
            lines += [f"The whole module: `{source_file(name)}`.", ""]
            continue
        lines += ["| name | file | |", "|---|---|---|"]
        for public, where in sorted(exports(name).items(), key=lambda kv: kv[0].lower()):
            lines.append(f"| `{public}` | `{source_file(where)}` | {summary(where, public)} |")
        lines.append("")
    return "\n".join(lines)


def _listed(nav) -> set[str]:
    """Every page path named in a navigation tree."""
    out: set[str] = set()
    for item in nav or []:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            out |= _listed(value)
        elif isinstance(value, str):
            out.add(value)
    return out


def is_public(name: str) -> bool:
    """Whether the page of module ``name`` belongs in the API reference (else under Internals)."""
    return name in PUBLIC_MODULES or (_is_package(name) and name not in INTERNAL_PACKAGES)


def on_config(config):
    public = [{name: page(name)} for name in modules() if is_public(name)]
    internal = [{name: page(name)} for name in modules() if not is_public(name)]
    nav = config.get("nav") or []
    docs = Path(config["docs_dir"])
    unlisted = sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*.md")
                      if p.relative_to(docs).as_posix() not in _listed(nav))
    if unlisted:                     # a page added without a nav entry still gets one (titled by its heading)
        nav.insert(len(nav) - 1 if nav else 0, {"More": unlisted})
    for section, entries in ((SECTION, public), (INTERNALS, internal)):
        for item in nav:
            if isinstance(item, dict) and section in item:
                item[section] = [*(item[section] or []), *entries]
                break
        else:
            nav.append({section: entries})
    config["nav"] = nav
    return config


def on_files(files, config):
    for name in modules():
        content = public_page(name) if _is_package(name) and is_public(name) else f"# `{name}`\n\n::: {name}\n"
        files.append(File.generated(config, page(name), content=content))
    return files


ROLE = re.compile(r":(?:py:)?(func|class|meth|mod|attr|data|obj|exc|const):`~?([^`]+)`")
LITERAL = re.compile(r"(?m)(\S)::$")


def _role_text(match: re.Match) -> str:
    target = match.group(2)
    shown = target.rsplit(".", 1)[-1] if match.group(0).split("`", 1)[1].startswith("~") else target
    return f"`{shown}`"


def exists(dotted: str) -> bool:
    """``dotted`` names a module, or a module then attributes (a class's annotated fields and the
    ``self.name`` it assigns count as its attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if hasattr(obj, name):
                obj = getattr(obj, name)
            elif inspect.isclass(obj) and _instance_attribute(obj, name):
                obj = None
            else:
                return False
        return True
    return False


def _instance_attribute(cls: type, name: str) -> bool:
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*[:=]", source):
            return True
    return False


def candidates(target: str, scopes: list[str], package: str) -> list[str]:
    """Where a role's ``target`` may point, from a docstring whose enclosing objects are ``scopes``
    (innermost first, ending with its module) in ``package``: ``.x`` is relative to the package,
    ``..x`` to its parent; a bare or dotted name is looked up in each scope, then in ``attngeom``."""
    if target.startswith("."):
        rest = target.lstrip(".")
        base = package.split(".")
        base = base[: len(base) - (len(target) - len(rest) - 1)]
        return [".".join([*base, rest]), f"{scopes[-1]}.{rest}"]
    return [target, *(f"{s}.{target}" for s in scopes), f"{package}.{target}", f"attngeom.{target}"]


def unresolved(target: str, scopes: list[str], package: str) -> bool:
    """True when no candidate of ``target`` exists (see :func:`candidates`)."""
    return not any(exists(c) for c in candidates(target.strip("()"), scopes, package))


def docstring_roles(path: Path, module: str):
    """``(scopes, role, target)`` of every role in the docstrings of one source file, read statically."""
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def visit(node, scopes):
        docs = [ast.get_docstring(node, clean=False) or ""]
        body = getattr(node, "body", [])
        for before, after in zip(body, body[1:]):          # attribute docstrings: a string after an assignment
            if isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(after, ast.Expr) \
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs.append(after.value.value)
        for match in ROLE.finditer("\n".join(docs)):
            yield scopes, match.group(1), match.group(2)
        for child in body:
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, [f"{scopes[0]}.{child.name}", *scopes])

    yield from visit(tree, [module])


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def broken_references() -> list[str]:
    """Every role in the docstrings of ``src/attngeom`` whose target does not resolve."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        module = ".".join(["attngeom", *parts])
        for scopes, role, target in docstring_roles(path, module):
            if unresolved(target, scopes, _package(module, path)):
                bad.append(f"{path.relative_to(ROOT.parent.parent)}: {scopes[0]}: :{role}:`{target}` does not resolve")
    return bad


log = logging.getLogger("mkdocs.hooks.attngeom")


def on_pre_build(config):
    """A docstring's cross-reference that points nowhere fails the strict build."""
    for line in broken_references():
        log.warning(line)


class SphinxRoles(Extension):
    """Sphinx roles in docstrings -> Markdown code spans (``:func:`~a.b``` -> `` `b` ``); ``text::`` -> ``text:``."""

    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = LITERAL.sub(r"\1:", ROLE.sub(_role_text, obj.docstring.value))
