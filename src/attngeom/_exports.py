"""Lazy re-exports for package ``__init__`` modules (PEP 562).

A package lists its public names and the submodule that defines each; a name is imported on first
use (a submodule too, as an attribute), so importing a package (or ``attngeom --help``) stays cheap and no import cycle can pass
through a package ``__init__``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys


def lazy(package: str, exports: dict[str, str]):
    """Return ``(__getattr__, __dir__, __all__)`` for *package*, whose public names are the keys of
    *exports* and whose values are the defining submodules (relative to *package*)."""

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")          # a submodule, as after its import
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__, sorted(exports)
