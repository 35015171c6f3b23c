"""Head taxonomy of SPEC §6 (paper 2): Retriever / Mixer / Reset by the source winner.

The *source winner* of head ``h`` at query ``i`` is ``j* = argmax_j a_ij^h ‖v_j^h‖`` (option: the
projected norm ``‖ṽ_j^h‖``). The query is labelled *self* (``j* = i``), *sink* (``j* = 0``) or
*other*; queries ``i = 0`` are skipped. The head's regime is its most frequent label over the
corpus (plurality, no thresholds; exact ties go to the first of self, sink, other):

- **Retriever** — self, **Mixer** — sink, **Reset** — other (no single privileged source).

The per-query counting is :class:`attngeom.streaming.reducers.HeadStats` (its ``winner_self`` /
``winner_sink`` / ``winner_other`` shares); :class:`TaxonomyStats` extends it with each head's mean
**alignment** with the sink and with the current token, in model space:

- ``align_sink`` = mean over queries ``i >= 1`` of ``cos(o_i^h, ṽ_0^h)``,
- ``align_self`` = mean over queries ``i >= 1`` of ``cos(o_i^h, ṽ_i^h)``,

computed in head space as ``⟨o_i^h, ṽ_j^h⟩ = (u_i^h G^h)·v_j^h`` (SPEC §2). A regime's alignment is
the mean of its heads' alignments.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from attngeom.capture.blocks import Block
from attngeom.metrics.formulas import safe_div
from attngeom.streaming.reducers import HeadStats, as_sums

REGIMES = ("Retriever", "Mixer", "Reset")
LABELS = ("self", "sink", "other")
SHARE_COLUMNS = ("winner_self", "winner_sink", "winner_other")


def _safe_cos(dot: torch.Tensor, n1: torch.Tensor, n2: torch.Tensor) -> torch.Tensor:
    """``dot / (n1·n2)``, 0 where a norm is 0 (:func:`attngeom.metrics.formulas.safe_div`)."""
    return safe_div(dot, n1 * n2)


class TaxonomyStats(HeadStats):
    """:class:`HeadStats` plus ``align_sink`` and ``align_self`` (module docstring); ``result()``
    adds each head's ``regime``. ``winner_norm`` is ``"raw"`` (``‖v_j‖``, default) or
    ``"projected"`` (``‖ṽ_j‖``)."""

    FIELDS = HeadStats.FIELDS + ("align_sink", "align_self")

    FIELD_NEEDS = {**HeadStats.FIELD_NEEDS, "align_sink": ("uG", "head_output_norm", "value_norm"),
                   "align_self": ("uG", "head_output_norm", "value_norm")}

    def per_query(self, block: Block) -> dict:
        out = super().per_query(block)
        st = block.state

        def align_self():
            qpos = block.q_positions.clamp_max(st.v.shape[2] - 1)
            v_self = st.v[:, :, qpos]                                      # [B, H, Q, d]
            return _safe_cos((block.uG * v_self).sum(-1), block.head_output_norm, st.value_norm[:, :, qpos])

        def align_sink():
            if self.sink >= st.v.shape[2]:
                return torch.zeros(block.shape[:3], device=block.a.device)
            v0 = st.v[:, :, self.sink]                                     # [B, H, d]
            return _safe_cos((block.uG * v0[:, :, None]).sum(-1), block.head_output_norm,
                             st.value_norm[:, :, self.sink][..., None])

        out.update(align_self=align_self, align_sink=align_sink)
        return out

    def merge(self, other: "HeadStats") -> "TaxonomyStats":
        """Add another reducer's sums (e.g. a calibration and a held-out pass of one corpus)."""
        for layer, sums in other.sums.items():     # each side's sums may be on its own device: added on ours
            mine = self.sums.setdefault(layer, {k: torch.zeros_like(x) for k, x in sums.items()})
            for k, x in sums.items():
                mine[k] = mine[k] + x.to(mine[k].device)
            device = next(iter(mine.values())).device
            self.counts[layer] = as_sums(self.counts.get(layer, 0.0), device) + as_sums(other.counts[layer], device)
        return self

    def result(self) -> pd.DataFrame:
        df = super().result()
        if len(df):
            df["regime"] = regimes_of(df)
        return df


def regimes_of(df: pd.DataFrame) -> np.ndarray:
    """Plurality regime per row from the ``winner_self/sink/other`` shares (ties: first of them)."""
    shares = df[list(SHARE_COLUMNS)].to_numpy()
    return np.asarray(REGIMES, dtype=object)[shares.argmax(1)]


def share_of_each_regime(regime: np.ndarray) -> np.ndarray:
    """Fraction of heads in each regime, written once for :func:`regime_shares` (one sample) and
    :func:`attngeom.heads.experiment.resampled` (resamples): ``regime [R, K]``, the index in
    :data:`REGIMES` of each of ``K`` heads -> ``[R, 3]`` (0 without heads)."""
    regime = np.asarray(regime)
    if regime.shape[1] == 0:
        return np.zeros((regime.shape[0], len(REGIMES)))
    return np.stack([(regime == k).mean(1) for k in range(len(REGIMES))], 1)


def regime_shares(df: pd.DataFrame) -> dict[str, float]:
    """Fraction of heads in each regime (:func:`share_of_each_regime`)."""
    index = {r: k for k, r in enumerate(REGIMES)}
    shares = share_of_each_regime(np.array([[index.get(r, -1) for r in df["regime"]]]))[0]
    return {r: float(x) for r, x in zip(REGIMES, shares)}


def shares_by_layer(df: pd.DataFrame) -> pd.DataFrame:
    """Per layer: fraction of its heads in each regime (columns ``Retriever, Mixer, Reset``)."""
    tab = pd.crosstab(df["layer"], df["regime"], normalize="index")
    for r in REGIMES:
        if r not in tab:
            tab[r] = 0.0
    return tab[list(REGIMES)].reset_index()


def shares_by_depth(df: pd.DataFrame, num_layers: int, parts: int = 3) -> dict[str, dict[str, float]]:
    """Regime shares in the early / middle / late thirds of the layers (``parts`` equal bins)."""
    names = ["early", "middle", "late"] if parts == 3 else [f"part{k}" for k in range(parts)]
    bins = np.minimum((df["layer"].to_numpy() * parts) // max(1, num_layers), parts - 1)
    out = {}
    for k, name in enumerate(names):
        sub = df[bins == k]
        out[name] = regime_shares(sub)
    return out


def corpus_agreement(a: pd.DataFrame, b: pd.DataFrame) -> dict:
    """Agreement of two corpora's regimes over the same heads: raw agreement, Cohen's kappa, and the
    confusion counts."""
    m = a[["layer", "head", "regime"]].merge(b[["layer", "head", "regime"]], on=["layer", "head"], suffixes=("_a", "_b"))
    n = len(m)
    if n == 0:
        return {"heads": 0, "agreement": float("nan"), "kappa": float("nan")}
    agree = float((m["regime_a"] == m["regime_b"]).mean())
    pa = np.array([(m["regime_a"] == r).mean() for r in REGIMES])
    pb = np.array([(m["regime_b"] == r).mean() for r in REGIMES])
    pe = float((pa * pb).sum())
    kappa = (agree - pe) / (1 - pe) if pe < 1 else 1.0
    confusion = {ra: {rb: int(((m["regime_a"] == ra) & (m["regime_b"] == rb)).sum()) for rb in REGIMES} for ra in REGIMES}
    return {"heads": n, "agreement": agree, "kappa": float(kappa), "confusion": confusion}


def regime_alignment(df: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Each regime's mean ``align_sink`` and ``align_self`` (means over its heads) and head count."""
    out = {}
    for r in REGIMES:
        sub = df[df["regime"] == r]
        out[r] = {"heads": int(len(sub)),
                  "align_sink": float(sub["align_sink"].mean()) if len(sub) else None,
                  "align_self": float(sub["align_self"].mean()) if len(sub) else None}
    return out
