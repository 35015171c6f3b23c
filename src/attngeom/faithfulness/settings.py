"""The faithfulness experiment's settings and defaults (SPEC §3). Plain dataclasses, nothing heavy imported: the command reads them to build ``--help``, and its options default to these fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from attngeom.metrics import registry

def default_rankings() -> tuple[str, ...]:
    """The faithfulness experiment's default rankings: the paper's hierarchy
    (:func:`attngeom.metrics.registry.hierarchy`) and the random control."""
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

    def identity(self) -> dict:
        """What the run's identity records of these settings (:func:`attngeom.runs.contract.settings_identity`)."""
        from attngeom.runs.contract import settings_identity

        return settings_identity(self.record())
