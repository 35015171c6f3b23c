"""The settings of the corpus experiments with their defaults: one frozen dataclass per experiment.

What belongs here: the options an experiment runs with and their defaults, said once for the
experiment (the ``experiment()`` of :mod:`attngeom.faithfulness`, :mod:`~attngeom.sinks`,
:mod:`~attngeom.selection`, :mod:`~attngeom.heads`, :mod:`~attngeom.claims` and
:mod:`~attngeom.analysis` take them) and for its command (whose options default to these fields).
Plain dataclasses, nothing heavy imported: the commands read them to build ``--help``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from . import registry

if TYPE_CHECKING:  # pragma: no cover
    from .generate import Decoding


def default_rankings() -> tuple[str, ...]:
    """The faithfulness experiment's default rankings: the paper's hierarchy
    (:func:`attngeom.registry.hierarchy`) and the random control."""
    return (*registry.hierarchy(), "random")


@dataclass(frozen=True)
class FaithfulnessSettings:
    """The faithfulness experiment (SPEC §3): the rankings ``metrics`` (registry metrics and
    ``random``), removal ``ratios`` in (0, 1), ``seeds`` of the random ranking, ranking per head
    (``per_head``) and by absolute score (``absolute``), the intervened ``layers`` (None: all) and
    the variants of one unit per batched forward (``rows``; None: as many as fit ~3 GB of logits)."""

    metrics: tuple[str, ...] = field(default_factory=default_rankings)
    ratios: tuple[float, ...] = tuple(round(0.1 * k, 1) for k in range(1, 10))
    seeds: tuple[int, ...] = (0, 1, 2)
    per_head: bool = False
    absolute: bool = False
    layers: tuple[int, ...] | None = None
    rows: int | None = None

    def record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class HeadsSettings:
    """The head experiment (SPEC §6): the first ``calib_windows`` windows of the first corpus are
    the calibration split; held-out perplexity at each of the ``retentions`` (percent of heads
    kept); source winners by ``winner_norm`` (``raw`` ``a_ij‖v_j‖`` or ``projected``
    ``a_ij‖v_j W_O‖``) with the sink at position ``sink``; ``seed`` of the random order; a critical
    head exceeds ``mean + critical_k·std`` of its regime; ``batch_size`` windows per forward."""

    calib_windows: int = 4
    retentions: tuple[float, ...] = (100.0, 90.0, 75.0, 50.0, 25.0)
    winner_norm: str = "raw"
    sink: int = 0
    seed: int = 0
    critical_k: float = 3.0
    batch_size: int = 4

    def record(self) -> dict:
        return {**asdict(self), "retentions": list(self.retentions)}


@dataclass(frozen=True)
class SinksSettings:
    """The sinks experiment (SPEC §4): the sink at position ``sink``; statistics at ``layers`` and
    the sink (and control) removed at ``removal_layers`` (None: every layer); ``batch_size``
    windows per forward."""

    sink: int = 0
    layers: tuple[int, ...] | None = None
    removal_layers: tuple[int, ...] | None = None
    batch_size: int = 2

    def record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KVCacheSettings:
    """The KV-cache experiment (docs/kvcache.md): the eviction ``policies``
    (:mod:`attngeom.kvpolicies`), the ``budgets`` (entries kept per key/value head), ``chunk``
    tokens per forward pass (eviction between passes) and the ``n_resamples`` of the bootstrap
    intervals over windows."""

    policies: tuple[str, ...] = ("full", "window", "streamingllm", "h2o", "tova", "snapkv", "vatp", "contribution",
                                 "contribution_signed", "taxonomy")
    budgets: tuple[int, ...] = (64, 128, 256)
    chunk: int = 1
    n_resamples: int = 1000

    def record(self) -> dict:
        return asdict(self)


def generation_record(decoding: Decoding | None, chat: bool = False, system: str | None = None) -> dict:
    """What identifies a generation in a run's settings (empty without one)."""
    if decoding is None:
        return {}
    return {"generate": decoding.max_new_tokens, "sample": decoding.sample, "temperature": decoding.temperature,
            "top_p": decoding.top_p, "seed": decoding.seed, "chat": bool(chat), "system": system}


@dataclass(frozen=True)
class AnalyzeSettings:
    """The single-text analysis (:func:`attngeom.analysis.experiment`): summaries at ``layers``
    (None: all), maps of the ``figure_layers`` (None: the first, a middle and the last analysed
    layer) with per-head grids of ``heads`` (None: all), drawn only when the (first) window has at
    most ``max_map_tokens`` tokens; an input longer than the context cut into windows of ``window``
    tokens every ``stride`` (None: no windows; stride None: ``window - 1``, no overlap); the sink at
    position ``sink``. ``decoding`` (a :class:`~attngeom.generate.Decoding`; None: no generation)
    generates an answer to the text as a prompt, a user message through the chat template when
    ``chat`` (with the ``system`` message)."""

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

    def _layers(self):
        return "all" if self.layers is None else sorted(set(self.layers))

    def record(self) -> dict:
        """The options of one text as the run records them."""
        return {"layers": self._layers(),
                "figure_layers": None if self.figure_layers is None else list(self.figure_layers),
                "heads": "all" if self.heads is None else sorted(set(self.heads)),
                "window": self.window, "stride": self.stride, "sink": self.sink,
                "max_map_tokens": self.max_map_tokens, **generation_record(self.decoding, self.chat, self.system)}

    def answer_record(self) -> dict:
        """The options of corpus mode (:func:`attngeom.analysis.answer_experiment`) as the run records them."""
        return {"layers": self._layers(), "sink": self.sink,
                **generation_record(self.decoding, self.chat, self.system)}


POWERS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""The default selection sizes ``N`` (SPEC §5)."""
DISTANCES = ("euclidean", "cosine")
"""The distances of the selection geometry (SPEC §5)."""


@dataclass(frozen=True)
class SelectionSettings:
    """The selection experiment (SPEC §5; :class:`attngeom.selection.SelectionStats` holds the
    meaning of each option): sizes ``ns``, ``distances``, ``repeats`` random subsets per size seeded
    by ``seed``, the ``queries`` analysed per window (``"last"``, ``"all"`` or a sample size), the
    ``sink`` position, the sink-aware prediction (``predict``, with the cosine-decay fit up to
    ``max_lag``), the largest ``small_n_max`` of the best small N, the random control also without
    the sink (``random_without_sink``); statistics at ``layers`` (None: all), ``batch_size``
    windows per forward."""

    ns: tuple[int, ...] = POWERS
    distances: tuple[str, ...] = DISTANCES
    repeats: int = 8
    seed: int = 0
    queries: str | int = "last"
    sink: int = 0
    predict: bool = True
    max_lag: int = 256
    small_n_max: int = 16
    random_without_sink: bool = True
    layers: tuple[int, ...] | None = None
    batch_size: int = 2

    def stats_options(self) -> dict:
        """The keyword arguments of :class:`~attngeom.selection.SelectionStats`."""
        return {k: v for k, v in asdict(self).items() if k not in ("layers", "batch_size")}

    def record(self) -> dict:
        return asdict(self)


FIXED_REGIME_ORDER = ("Mixer", "Reset", "Retriever")
"""The a-priori taxonomy order of the claims (first removed first); see ``docs/claims.md``."""


@dataclass(frozen=True)
class ClaimsSettings:
    """The claims experiment. ``window`` and ``max_windows`` say how the command cuts the corpus;
    the others are the reduced experiments' options: faithfulness ``ratios`` and ``seeds`` of the
    random ranking, selection sizes ``ns`` and random ``repeats``, head-removal ``retentions``
    (percent of heads kept) with the first ``calib_windows`` windows as calibration split and the
    a-priori ``fixed_order`` of regimes beside the calibrated one, and the bootstrap
    (``n_resamples`` resamples seeded by ``seed``; ``critical_k`` the critical-head threshold)."""

    window: int = 128
    max_windows: int = 12
    calib_windows: int = 2
    ratios: tuple[float, ...] = tuple(round(0.1 * k, 1) for k in range(1, 10))  # SPEC §3.3's grid
    seeds: tuple[int, ...] = (0,)
    ns: tuple[int, ...] = (2, 4, 8, 16)
    repeats: int = 4
    retentions: tuple[float, ...] = (100.0, 90.0, 75.0, 50.0, 25.0)
    fixed_order: tuple[str, ...] = FIXED_REGIME_ORDER
    n_resamples: int = 1000
    seed: int = 0
    critical_k: float = 3.0

    def record(self, level: float) -> dict:
        """What a result records of them (``bootstrap``: the resamples; ``level``: the interval's)."""
        return {"calib_windows": self.calib_windows, "ratios": list(self.ratios), "seeds": list(self.seeds),
                "ns": list(self.ns), "repeats": self.repeats, "retentions": list(self.retentions),
                "fixed_order": list(self.fixed_order), "bootstrap": self.n_resamples, "seed": self.seed,
                "level": level, "critical_k": self.critical_k}
