"""The single-text analysis' settings and defaults. Plain dataclasses, nothing heavy imported: the command reads them to build ``--help``, and its options default to these fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attngeom.generation.settings import generation_record

if TYPE_CHECKING:  # pragma: no cover
    from attngeom.generation.decoding import Decoding

@dataclass(frozen=True)
class AnalyzeSettings:
    """The single-text analysis (:func:`attngeom.analysis.experiment.experiment`): summaries at ``layers``
    (None: all), maps of the ``figure_layers`` (None: the first, a middle and the last analysed
    layer) with per-head grids of ``heads`` (None: all), drawn only when the (first) window has at
    most ``max_map_tokens`` tokens; an input longer than the context cut into windows of ``window``
    tokens every ``stride`` (None: no windows; stride None: ``window - 1``, no overlap); the sink at
    position ``sink``. The answer tables rank special and chat-template tokens as sources only with
    ``rank_special`` (they are marked either way). ``decoding`` (a :class:`~attngeom.generation.decoding.Decoding`; None: no generation)
    generates an answer to the text as a prompt, a user message through the chat template when
    ``chat`` (with the ``system`` message). ``route``: how the capture computes the summaries (SPEC
    §10: ``auto``, ``fused`` or ``block``; :data:`attngeom.capture.routes.ROUTES`)."""

    layers: tuple[int, ...] | None = None
    figure_layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    window: int | None = None
    stride: int | None = None
    sink: int = 0
    max_map_tokens: int = 2048
    decoding: Decoding | None = None
    chat: bool = False
    system: str | None = None
    rank_special: bool = False
    route: str = "auto"

    def _layers(self):
        return "all" if self.layers is None else sorted(set(self.layers))

    def record(self) -> dict:
        """The options of one text as the run records them."""
        return {"layers": self._layers(),
                "figure_layers": None if self.figure_layers is None else list(self.figure_layers),
                "heads": "all" if self.heads is None else sorted(set(self.heads)),
                "window": self.window, "stride": self.stride, "sink": self.sink,
                "max_map_tokens": self.max_map_tokens, "rank_special": self.rank_special, "route": self.route,
                **generation_record(self.decoding, self.chat, self.system)}

    def identity(self, corpus: bool = False) -> dict:
        """What the run's identity records of these settings: :meth:`record` for one text,
        :meth:`answer_record` in corpus mode (``corpus``)."""
        return self.answer_record() if corpus else self.record()

    def answer_record(self) -> dict:
        """The options of corpus mode (:func:`attngeom.analysis.experiment.answer_experiment`) as the run records them."""
        return {"layers": self._layers(), "sink": self.sink, "rank_special": self.rank_special,
                **generation_record(self.decoding, self.chat, self.system)}
