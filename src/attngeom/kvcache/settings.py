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

    def identity(self) -> dict:
        """What the run's identity records of these settings: every field but ``n_resamples``
        (:func:`attngeom.runs.contract.settings_identity`)."""
        from attngeom.runs.contract import settings_identity

        return settings_identity(self.record(), omit=("n_resamples",))


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


TASK_POLICIES = ("random", "window", "streamingllm", "knorm", "h2o", "tova", "snapkv", "pyramidkv", "adakv", "vatp",
                 "criticalkv", "andpro", "laprox", "dropkv", "kvzip", "kvzip_plus", "contribution", "snap_contribution",
                 "adakv_contribution", "loo_head", "suppressor", "kvzip_contribution", "global_contribution")
"""The policies of ``attngeom kvtasks`` by default: every baseline and every geometry policy that
compresses to a ratio (not ``full``, the ratio-0 reference always run, nor ``taxonomy``)."""


@dataclass(frozen=True)
class KVTaskSettings:
    """Long-context tasks under compression once after the prefill (docs/kvcache.md): the
    ``policies``, the compression ``ratios`` (shares of the cache removed), the ``mode``
    (``question-agnostic``: only the context is compressed; ``query-aware``: the question too),
    ``chat`` (the chat template: None = when the model has one) and the ``n_resamples`` of the
    bootstrap intervals over examples."""

    policies: tuple[str, ...] = TASK_POLICIES
    ratios: tuple[float, ...] = (0.25, 0.5, 0.75, 0.875)
    mode: str = "question-agnostic"
    chat: bool | None = None
    n_resamples: int = 1000

    def record(self) -> dict:
        return asdict(self)

    def identity(self) -> dict:
        """What the run's identity records of these settings: every field but ``n_resamples``
        (:func:`attngeom.runs.contract.settings_identity`)."""
        from attngeom.runs.contract import settings_identity

        return settings_identity(self.record(), omit=("n_resamples",))


@dataclass(frozen=True)
class KVTaskInputs:
    """How ``attngeom kvtasks`` makes its examples (:mod:`attngeom.kvcache.ruler`): ``tasks``,
    ``length`` tokens per example, ``examples`` per task from example number ``first_example`` on,
    ``seed``, and the ``haystack`` of the needle tasks (``ruler``: RULER's own for each task, the
    shipped essays or the noise, :func:`attngeom.kvcache.ruler.task_haystack`; ``noise``: RULER's
    repeated sentences for every task; or a corpus file of real prose). Example ``i`` of a task is the same whatever the other numbers, so
    runs of ``first_example = 0, 10, 20, ...`` add up to one larger sample
    (``tools/kvtasks_merge.py``)."""

    tasks: tuple[str, ...] = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
                              "variable_tracking", "common_words", "frequent_words")
    length: int = 4096
    examples: int = 50
    first_example: int = 0
    seed: int = 0
    haystack: str = "ruler"
