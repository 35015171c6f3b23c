"""The KV-cache experiment's settings and defaults (docs/kvcache.md). Plain dataclasses, nothing heavy imported: the command reads them to build ``--help``, and its options default to these fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from attngeom.kvcache.policies import READING_POLICIES


@dataclass(frozen=True)
class KVCacheSettings:
    """The KV-cache experiment (docs/kvcache.md): the eviction ``policies``
    (:mod:`attngeom.kvcache.policies`), the ``budgets`` (entries kept per key/value head), ``chunk``
    tokens per forward pass (eviction between passes) and the ``n_resamples`` of the bootstrap
    intervals over windows. The default ``policies`` are
    :data:`~attngeom.kvcache.policies.READING_POLICIES`."""

    policies: tuple[str, ...] = READING_POLICIES
    budgets: tuple[int, ...] = (64, 128, 256)
    chunk: int = 1
    n_resamples: int = 1000

    def record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KVCacheInputs:
    """How ``attngeom kvcache`` reads its inputs (the command's defaults, said once): windows of
    ``window`` tokens, at most ``max_windows``; ``calibration_windows`` further windows for the
    taxonomy policy; with ``--answers``, at most ``max_examples`` examples and ``new_tokens`` greedy
    tokens each."""

    window: int = 1024
    max_windows: int = 4
    calibration_windows: int = 2
    max_examples: int = 16
    new_tokens: int = 16
