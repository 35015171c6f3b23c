"""The head experiment's settings and defaults (SPEC §6). Plain dataclasses, nothing heavy imported: the command reads them to build ``--help``, and its options default to these fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class HeadsSettings:
    """The head experiment (SPEC §6): the first ``calib_windows`` windows of the first corpus are
    the calibration split; held-out perplexity at each of the ``retentions`` (percent of heads
    kept); source winners by ``winner_norm`` (``raw`` ``a_ij‖v_j‖`` or ``projected``
    ``a_ij‖v_j W_O‖``) with the sink at position ``sink``; ``seed`` of the random order; a critical
    head exceeds ``mean + critical_k·std`` of its regime; ``batch_size`` windows per forward."""

    calib_windows: int = 10   # stats.resampling.MIN_UNITS: the fewest the critical-head rule and the regime order rest on
    retentions: tuple[float, ...] = (100.0, 90.0, 75.0, 50.0, 25.0)
    winner_norm: str = "raw"
    sink: int = 0
    seed: int = 0
    critical_k: float = 3.0
    batch_size: int = 4

    def record(self) -> dict:
        return {**asdict(self), "retentions": list(self.retentions)}

    def identity(self) -> dict:
        """What the run's identity records of these settings (:func:`attngeom.runs.contract.settings_identity`)."""
        from attngeom.runs.contract import settings_identity

        return settings_identity(self.record())
