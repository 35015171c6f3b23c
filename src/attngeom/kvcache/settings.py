"""The KV-cache experiment's settings and defaults (docs/kvcache.md). Plain dataclasses, nothing heavy imported: the command reads them to build ``--help``, and its options default to these fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class KVCacheSettings:
    """The KV-cache experiment (docs/kvcache.md): the eviction ``policies``
    (:mod:`attngeom.kvcache.policies`), the ``budgets`` (entries kept per key/value head), ``chunk``
    tokens per forward pass (eviction between passes) and the ``n_resamples`` of the bootstrap
    intervals over windows."""

    policies: tuple[str, ...] = ("full", "window", "streamingllm", "h2o", "tova", "snapkv", "vatp", "contribution",
                                 "contribution_signed", "taxonomy")
    budgets: tuple[int, ...] = (64, 128, 256)
    chunk: int = 1
    n_resamples: int = 1000

    def record(self) -> dict:
        return asdict(self)
