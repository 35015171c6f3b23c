"""Corpora and windows: :mod:`.corpora`."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "SAMPLE_TEXT": "corpora",
    "read_texts": "corpora",
    "resolve_texts": "corpora",
    "windows": "corpora",
    "load_windows": "corpora",
})
