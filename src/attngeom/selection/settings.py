"""The selection experiment's settings and defaults (SPEC §5). Plain dataclasses, nothing heavy imported: the command reads them to build ``--help``, and its options default to these fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass


POWERS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""The default selection sizes ``N`` (SPEC §5)."""
DISTANCES = ("euclidean", "cosine")
"""The distances of the selection geometry (SPEC §5)."""


@dataclass(frozen=True)
class SelectionSettings:
    """The selection experiment (SPEC §5; :class:`attngeom.selection.reducer.SelectionStats` holds the
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
        """The keyword arguments of :class:`~attngeom.selection.reducer.SelectionStats`."""
        return {k: v for k, v in asdict(self).items() if k not in ("layers", "batch_size")}

    def record(self) -> dict:
        return asdict(self)

    def identity(self) -> dict:
        """What the run's identity records of these settings (:func:`attngeom.runs.contract.settings_identity`)."""
        from attngeom.runs.contract import settings_identity

        return settings_identity(self.record())
