"""The KV-cache experiment's settings and defaults (docs/kvcache.md). Plain dataclasses, nothing heavy imported: the command reads them to build ``--help``, and its options default to these fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from attngeom.kvcache.policies import POLICIES


@dataclass(frozen=True)
class KVCacheSettings:
    """The KV-cache experiment (docs/kvcache.md): the eviction ``policies``
    (:mod:`attngeom.kvcache.policies`), the ``budgets`` (entries kept per key/value head), ``chunk``
    tokens per forward pass (eviction between passes) and the ``n_resamples`` of the bootstrap
    intervals over windows. The default ``policies`` are every policy of
    :data:`~attngeom.kvcache.policies.POLICIES`, in its order."""

    policies: tuple[str, ...] = tuple(POLICIES)
    budgets: tuple[int, ...] = (64, 128, 256)
    chunk: int = 1
    n_resamples: int = 1000

    def record(self) -> dict:
        return asdict(self)
