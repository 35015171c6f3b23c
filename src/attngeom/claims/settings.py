"""The claims experiment's settings and defaults (docs/claims.md). Plain dataclasses, nothing heavy imported: the command reads them to build ``--help``, and its options default to these fields."""

from __future__ import annotations

from dataclasses import dataclass


FIXED_REGIME_ORDER = ("Mixer", "Reset", "Retriever")
"""The a-priori taxonomy order of the claims (first removed first); see ``docs/claims.md``."""


@dataclass(frozen=True)
class ClaimsSettings:
    """The claims experiment. ``window`` and ``max_windows`` say how the command cuts the corpus;
    the others are the reduced experiments' options: faithfulness ``ratios`` and ``seeds`` of the
    random ranking, selection sizes ``ns`` and random ``repeats``, head-removal ``retentions``
    (percent of heads kept) with the first ``calib_windows`` windows as calibration split and the
    a-priori ``fixed_order`` of regimes beside the calibrated one, and the bootstrap
    (``n_resamples`` resamples seeded by ``seed``; ``critical_k`` the critical-head threshold).
    ``per_head``: the faithfulness rankings are per head (SPEC §3's option) instead of per token;
    ``rivals``: the measures of the head-to-head rows (:meth:`head_to_head`)."""

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
    per_head: bool = False
    rivals: tuple[str, ...] | None = None

    def head_to_head(self) -> tuple[str, ...]:
        """The published measures the head-to-head rows set against contribution: ``rivals`` (None:
        every one of :func:`attngeom.metrics.registry.rivals`), and with ``per_head`` only those with a
        per-head map (a layer-only measure has no per-head ranking)."""
        from attngeom.metrics import registry

        names = registry.rivals() if self.rivals is None else tuple(self.rivals)
        return tuple(n for n in names if not (self.per_head and registry.get(n).layer_only))

    def record(self, level: float | None = None) -> dict:
        """What a result records of them (``bootstrap``: the resamples; ``level``, when given: the
        interval's). ``window`` and ``max_windows`` are the command's (its corpus identity)."""
        return {"calib_windows": self.calib_windows, "ratios": list(self.ratios), "seeds": list(self.seeds),
                "ns": list(self.ns), "repeats": self.repeats, "retentions": list(self.retentions),
                "fixed_order": list(self.fixed_order), "bootstrap": self.n_resamples, "seed": self.seed,
                **({} if level is None else {"level": level}), "critical_k": self.critical_k,
                # recorded when set, so that the runs made before these options keep their identity
                **({"per_head": True} if self.per_head else {}),
                **({} if self.rivals is None else {"rivals": list(self.rivals)})}

    def identity(self) -> dict:
        """What the run's identity records of these settings: :meth:`record` without ``critical_k``
        (no option of the command: the identity holds what its options change)."""
        from attngeom.runs.contract import settings_identity

        return settings_identity(self.record(), omit=("critical_k",))
