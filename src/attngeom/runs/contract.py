"""The one contract of every experiment (faithfulness, sinks, selection, heads, claims, kvcache,
analysis), and the one perplexity rule they share.

What belongs here: the shape every ``experiment()`` function of attngeom returns
(:class:`ExperimentResult`), the two things an experiment is handed (a model handle and a run, as
:class:`ModelHandleLike` and :class:`RunLike` protocols), :func:`window_records` and
:func:`perplexity`. No model code, no experiment's own logic.

Every experiment has one signature, ``experiment(handle, run, inputs, settings, *, options)``: ``run`` may
be None (:func:`attngeom.runs.run.run_or_in_memory`: computed in memory, nothing recorded), the inputs
(windows, units, corpora or a text) come third, the settings fourth, anything else is keyword-only.
An experiment is **settings** (one frozen dataclass in the ``settings`` module of its package, recorded in the
result), **stages of units**
run through :meth:`RunLike.stage` (resumable, shareable among processes: each finished unit group
is a record), and a **result**: its ``tables`` (DataFrames, what a command writes), its ``summary``
(a JSON-able dict) and its ``per_window`` statistics (additive sums per window, the rows a
bootstrap over windows resamples; :mod:`attngeom.stats.resampling`). :mod:`attngeom.claims.experiment` composes the
other experiments through their results only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    import torch

    from attngeom.model.adapter import ArchitectureAdapter


# --------------------------------------------------------------------------------------------
# Perplexity: one rule for every experiment
# --------------------------------------------------------------------------------------------


MIN_SCORED_TOKENS = 16
"""The fewest predicted tokens a perplexity change is computed from: on fewer, one token's loss
moves the perplexity by orders of magnitude (a 4-token text's sink removal reads as ΔPPL −3,530)."""


def check_scorable(tokens: int, what: str) -> None:
    """Refuse (:class:`~attngeom.errors.InputError`, one line) a perplexity change on fewer than
    :data:`MIN_SCORED_TOKENS` predicted tokens."""
    from attngeom.errors import InputError

    if tokens < MIN_SCORED_TOKENS:
        raise InputError(f"{what} has {tokens} predicted token(s); a perplexity change needs at least "
                         f"{MIN_SCORED_TOKENS}: give longer or more texts")


def perplexity(nll, tokens):
    """``PPL = exp(Σ NLL / Σ tokens)`` from a summed next-token NLL and its token count.

    Scalars give a float (``math.exp``), arrays an array (elementwise ``numpy.exp``, broadcast).
    **Zero tokens give NaN**: nothing was predicted, so there is no perplexity (never ``exp(0) = 1``
    and never a division by zero)."""
    if np.ndim(nll) == 0 and np.ndim(tokens) == 0:
        n, t = float(nll), float(tokens)
        return math.exp(n / t) if t > 0 else float("nan")
    nll = np.asarray(nll, dtype=np.float64)
    tok = np.asarray(tokens, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tok > 0, np.exp(nll / np.where(tok > 0, tok, 1.0)), np.nan)


# --------------------------------------------------------------------------------------------
# What an experiment is handed
# --------------------------------------------------------------------------------------------


@runtime_checkable
class ModelHandleLike(Protocol):
    """What the experiments use of a model handle (:class:`attngeom.model.handle.ModelHandle`)."""

    model: Any
    tokenizer: Any
    name: str

    @property
    def adapter(self) -> "ArchitectureAdapter": ...

    @property
    def config(self) -> Any: ...

    @property
    def device(self) -> "torch.device": ...

    @property
    def dtype(self) -> "torch.dtype": ...

    @property
    def architecture(self) -> str: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def max_positions(self) -> int | None: ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def tokens(self, ids) -> list[str]: ...


class Comm(Protocol):
    rank: int
    world: int

    def barrier(self) -> None: ...

    def all_gather(self, obj) -> list: ...

    def broadcast(self, obj): ...


@runtime_checkable
class RunLike(Protocol):
    """What the experiments use of a run (:class:`attngeom.runs.run.Run` with an output folder, or
    :class:`attngeom.runs.run.InMemoryRun` in memory, which an experiment makes itself from ``run=None``): stages of units whose records are returned keyed
    by the tuple of units each record covers."""

    comm: Comm
    progress: Any

    def stage(self, name: str, n_units: int, work: Callable[[list[int]], object], *, group: int = 1,
              group_key: Callable[[int], object] | None = None, units: Sequence[int] | None = None,
              **kw) -> dict[tuple[int, ...], Any]: ...


# --------------------------------------------------------------------------------------------
# What an experiment returns
# --------------------------------------------------------------------------------------------


@dataclass
class ExperimentResult:
    """The result of an experiment: ``tables`` (name -> DataFrame, what a command writes),
    ``summary`` (a JSON-able dict), ``per_window`` (additive per-window statistics a bootstrap over
    windows resamples: arrays or lists with one entry per window, in window order) and
    ``settings`` (the options it ran with, as the settings dataclass records them)."""

    name: str
    tables: dict[str, "pd.DataFrame"] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    per_window: dict[str, Any] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)


def window_records(records: Mapping[tuple[int, ...], Any]) -> list | None:
    """The records of a stage in window order when each covers exactly one window (unit), as a
    bootstrap over windows needs them; None when some record covers several (a batched stage)."""
    keys = sorted(records, key=lambda k: k[0])
    if any(len(k) != 1 for k in keys):
        return None
    return [records[k] for k in keys]


def layer_order(d: Mapping) -> list:
    """Keys of a per-layer dict in layer order (keys are ints or their strings, as records store them)."""
    return sorted(d, key=lambda k: int(k))


def per_window_array(records: Sequence, get: Callable[[Any], Any]) -> np.ndarray:
    """``get(record)`` of each window's record stacked: float64 ``[W, ...]`` (the rows a bootstrap
    over windows resamples)."""
    return np.stack([np.asarray(get(r), dtype=np.float64) for r in records])


def one_window_each(per_window: Mapping[str, Any], key: str, analysis: str) -> list:
    """``per_window[key]``: an experiment's records of one window each (what :func:`window_records`
    gave; missing when the records were batched)."""
    recs = per_window.get(key)
    if recs is None:
        raise ValueError(f"the {analysis} summary under resampling needs one window per record (batch_size=1)")
    return recs


# --------------------------------------------------------------------------------------------
# What identifies a run
# --------------------------------------------------------------------------------------------


BATCHING = ("batch_size", "rows")
"""Settings fields that say how the work is batched (windows per forward pass, variants per batched
forward), not what is computed: no part of a run's identity."""


def layers_identity(layers) -> str | list[int]:
    """Layers as a run's identity records them: ``"all"`` for None, else sorted, each once."""
    return "all" if layers is None else sorted(set(layers))


def settings_identity(record: Mapping, omit: Sequence[str] = ()) -> dict:
    """What a run's identity records of an experiment's settings (``record``, as the settings
    dataclass records them; each dataclass's ``identity()`` calls this): every field but those of
    :data:`BATCHING` and ``omit``, layer lists (``layers``, ``*_layers``) as :func:`layers_identity`
    writes them."""
    return {k: layers_identity(v) if k == "layers" or k.endswith("_layers") else v
            for k, v in record.items() if k not in BATCHING and k not in omit}
