"""The explorer's settings and defaults. A plain dataclass, nothing heavy imported: ``attngeom
explore`` reads it to build ``--help``, and its options default to these fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ExploreSettings:
    """What :func:`attngeom.explorer.data.build` keeps: every source (exact maps) up to
    ``exact_max_tokens`` tokens, beyond that the ``top_k`` sources per (layer, head, query); the
    sink at position ``sink``."""

    top_k: int = 8
    exact_max_tokens: int = 512
    sink: int = 0

    def record(self) -> dict:
        return asdict(self)
