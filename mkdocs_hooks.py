"""MkDocs hook: one API reference page per public module of ``src/attngeom``, generated at build time.

Pages in ``docs/`` that ``mkdocs.yml``'s ``nav`` does not name are listed under "More", so a new
page never breaks the strict build. Every module whose name does not start with ``_`` gets a page ``api/<dotted name>.md`` holding
``::: attngeom.<name>`` (mkdocstrings renders it from the docstrings, read statically by griffe,
nothing imported), and an entry under "API reference" in the navigation. A module added or removed
in ``src/attngeom`` therefore appears or disappears without editing ``mkdocs.yml``. The command line
(``cli``, ``commands``) and the report writers (``reports``) are left out: ``attngeom COMMAND --help``
documents the former, and the latter are internal to the commands.

:class:`SphinxRoles` is a griffe extension (named in ``mkdocs.yml``): the docstrings use Sphinx roles
(``:func:`name```, ``:class:`~attngeom.x.Y```), which Markdown would show literally; it turns each
into a code span (``name``, ``Y``), and the reStructuredText literal-block marker ``text::`` into
``text:`` (the indented block after it is already a Markdown code block), before mkdocstrings
renders the docstring.
"""

from __future__ import annotations

import re
from pathlib import Path

from griffe import Extension
from mkdocs.structure.files import File

ROOT = Path(__file__).parent / "src" / "attngeom"
EXCLUDED = {"cli", "commands", "reports"}
SECTION = "API reference"


def modules() -> list[str]:
    """Dotted names of the public modules, package first, then in alphabetical order."""
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


def page(name: str) -> str:
    return f"api/{name}.md"


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


def on_config(config):
    entries = [{name: page(name)} for name in modules()]
    nav = config.get("nav") or []
    docs = Path(config["docs_dir"])
    unlisted = sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*.md")
                      if p.relative_to(docs).as_posix() not in _listed(nav))
    if unlisted:                     # a page added without a nav entry still gets one (titled by its heading)
        nav.insert(len(nav) - 1 if nav else 0, {"More": unlisted})
    for item in nav:
        if isinstance(item, dict) and SECTION in item:
            item[SECTION] = [*(item[SECTION] or []), *entries]
            break
    else:
        nav.append({SECTION: entries})
    config["nav"] = nav
    return config


def on_files(files, config):
    for name in modules():
        files.append(File.generated(config, page(name), content=f"# `{name}`\n\n::: {name}\n"))
    return files


ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const):`~?([^`]+)`")
LITERAL = re.compile(r"(?m)(\S)::$")


def _role_text(match: re.Match) -> str:
    target = match.group(1)
    shown = target.rsplit(".", 1)[-1] if match.group(0).split("`", 1)[1].startswith("~") else target
    return f"`{shown}`"


class SphinxRoles(Extension):
    """Sphinx roles in docstrings -> Markdown code spans (``:func:`~a.b``` -> `` `b` ``); ``text::`` -> ``text:``."""

    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = LITERAL.sub(r"\1:", ROLE.sub(_role_text, obj.docstring.value))
