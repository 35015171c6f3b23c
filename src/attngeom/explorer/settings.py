"""The explorer's settings and defaults. A plain dataclass, nothing heavy imported: ``attngeom
explore`` reads it to build ``--help``, and its options default to these fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attngeom.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from attngeom.generation.decoding import Decoding


PAD = 0xFFFF
"""Index padding in top-k rows (a query with fewer than k visible sources): written by
:mod:`attngeom.explorer.data`, read by the page (:mod:`attngeom.reports.explore`)."""


@dataclass(frozen=True)
class ExploreSettings:
    """What :func:`attngeom.explorer.data.build` keeps: every source (exact maps) up to
    ``exact_max_tokens`` tokens, beyond that the ``top_k`` sources per (layer, head, query); the
    sink at position ``sink``; ``measure``: a registry measure shown beside attention and
    contribution (None: none); the ``layers`` explored (None: all); ``decoding`` (a
    :class:`~attngeom.generation.decoding.Decoding`; None: no generation) explores the text as a
    prompt and the model's answer, a user message through the chat template when ``chat`` (with
    the ``system`` message)."""

    top_k: int = 8
    exact_max_tokens: int = 512
    sink: int = 0
    measure: str | None = None
    layers: tuple[int, ...] | None = None
    decoding: Decoding | None = None
    chat: bool = False
    system: str | None = None

    def record(self) -> dict:
        """The settings as a run records them; ``measure`` only when set, so that the runs made
        before that option keep their identity; the generation's as
        :func:`attngeom.generation.settings.generation_record` writes them (nothing without one)."""
        from attngeom.generation.settings import generation_record
        from attngeom.runs.contract import layers_identity

        out = {"layers": layers_identity(self.layers), "top_k": self.top_k,
               "exact_max_tokens": self.exact_max_tokens, "sink": self.sink}
        if self.measure is not None:
            out["measure"] = self.measure
        return {**out, **generation_record(self.decoding, self.chat, self.system)}

    def identity(self) -> dict:
        """What the run's identity records of these settings: :meth:`record`."""
        return self.record()


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
