"""The explorer's settings and defaults. A plain dataclass, nothing heavy imported: ``attngeom
explore`` reads it to build ``--help``, and its options default to these fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from attngeom.errors import InputError


@dataclass(frozen=True)
class ExploreSettings:
    """What :func:`attngeom.explorer.data.build` keeps: every source (exact maps) up to
    ``exact_max_tokens`` tokens, beyond that the ``top_k`` sources per (layer, head, query); the
    sink at position ``sink``; ``measure``: a registry measure shown beside attention and
    contribution (None: none)."""

    top_k: int = 8
    exact_max_tokens: int = 512
    sink: int = 0
    measure: str | None = None

    def record(self) -> dict:
        """The settings as a run records them; ``measure`` only when set, so that the runs made
        before that option keep their identity."""
        out = asdict(self)
        if self.measure is None:
            del out["measure"]
        return out


def check_measure(name: str | None, *, generation: bool = False) -> str | None:
    """``name`` when it is a measure of :mod:`attngeom.metrics.registry` the explorer can show (None:
    none); else one-line :class:`~attngeom.errors.InputError`. A measure computed before the forward
    (``prepare``: gradients, rollouts) is defined for a text as given, so ``generation`` refuses it."""
    if name is None:
        return None
    from attngeom.metrics import registry

    if name not in registry.METRICS:
        raise InputError(f"unknown measure {name!r}; known: {', '.join(registry.names())}")
    if generation and registry.get(name).prepare is not None:
        raise InputError(f"{name} is computed before the forward from a text as given (a backward pass or a "
                         "composition of layers), not for a generation: explore it without --generate")
    return name
