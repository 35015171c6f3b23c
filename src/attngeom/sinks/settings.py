"""The sinks experiment's settings and defaults (SPEC §4). Plain dataclasses, nothing heavy imported: the command reads them to build ``--help``, and its options default to these fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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

    def identity(self) -> dict:
        """What the run's identity records of these settings (:func:`attngeom.runs.contract.settings_identity`)."""
        from attngeom.runs.contract import settings_identity

        return settings_identity(self.record())
