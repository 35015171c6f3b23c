"""The removal orders of SPEC §6 and the individually critical heads: the pure math, on tables and
arrays (no model; :mod:`attngeom.heads.experiment` measures them).

**Orders** (each ranks all ``L·H`` heads from first-removed to last-removed; at retention ``r`` the
first ``L·H − round(r·L·H/100)`` heads of the order are removed):

- ``taxonomy``: heads grouped by regime (Retriever / Mixer / Reset, from the calibration split); the
  order in which the three regimes are removed is the permutation of the three with the lowest
  mean log-perplexity over the retentions below 100 % on the calibration split (all six are tried).
  Inside a regime, heads with the largest share of their regime's label go first (the most typical
  members of the regime), ties by (layer, head).
- ``weight``: ascending ``‖W_O^h‖_F · ‖W_V^{g(h)}‖_F`` (output-projection block of the head times the
  value projection of its key/value head) — smallest first.
- ``entropy``: descending mean attention entropy on the calibration split — most diffuse first.
- ``random``: a seeded permutation.
- ``sensitivity``: ascending single-head ΔPPL on the calibration split — least harmful first.

**Critical heads.** A head is *individually critical* when its single-removal ΔPPL on the
calibration split exceeds ``mean + 3·std`` of the single-removal ΔPPLs of the *other* heads of its
regime (leave-one-out, so that the outlier does not inflate its own threshold; regimes with fewer
than 8 other heads use all other heads of the model instead), and is positive.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

ORDERS = ("taxonomy", "weight", "entropy", "random", "sensitivity")
REGIME_LABEL = {"Retriever": "winner_self", "Mixer": "winner_sink", "Reset": "winner_other"}


def _rank(values: np.ndarray, ascending: bool = True) -> list[tuple[int, int]]:
    L, H = values.shape
    flat = values.reshape(-1)
    keys = flat if ascending else -flat
    idx = np.lexsort((np.arange(L * H), keys))  # stable: ties by (layer, head)
    return [(int(i // H), int(i % H)) for i in idx]


def taxonomy_order(tax: pd.DataFrame, regime_order: Sequence[str]) -> list[tuple[int, int]]:
    """Heads regime by regime in ``regime_order``; inside a regime the largest label share first."""
    out = []
    for r in regime_order:
        sub = tax[tax["regime"] == r].copy()
        sub["_share"] = sub[REGIME_LABEL[r]]
        sub = sub.sort_values(["_share", "layer", "head"], ascending=[False, True, True], kind="mergesort")
        out.extend((int(a), int(b)) for a, b in zip(sub["layer"], sub["head"]))
    return out


def removed_at(order: Sequence[tuple[int, int]], retention: float) -> list[tuple[int, int]]:
    """The heads removed at ``retention`` percent: the first ``total − round(r·total/100)``."""
    total = len(order)
    keep = int(round(retention * total / 100.0))
    return list(order[: total - keep])


def build_orders(tax: pd.DataFrame, weights: np.ndarray, sensitivity: np.ndarray, regime_order: Sequence[str],
                 seed: int = 0) -> dict[str, list[tuple[int, int]]]:
    """All five removal orders (module docstring). ``tax`` must hold ``layer, head, regime, entropy``
    and the winner shares (calibration split)."""
    L, H = weights.shape
    ent = np.zeros((L, H))
    for row in tax.itertuples():
        ent[row.layer, row.head] = row.entropy
    rng = np.random.default_rng(seed)
    perm = rng.permutation(L * H)
    return {
        "taxonomy": taxonomy_order(tax, regime_order),
        "weight": _rank(weights, ascending=True),
        "entropy": _rank(ent, ascending=False),
        "random": [(int(i // H), int(i % H)) for i in perm],
        "sensitivity": _rank(sensitivity, ascending=True),
    }


def critical_heads(sensitivity: np.ndarray, tax: pd.DataFrame, k: float = 3.0, min_group: int = 8) -> list[dict]:
    """Heads whose single-removal ΔPPL exceeds ``mean + k·std`` of the other heads of their regime
    (leave-one-out; fewer than ``min_group`` others -> all other heads), and is positive."""
    regime = {(int(r.layer), int(r.head)): r.regime for r in tax.itertuples()}
    L, H = sensitivity.shape
    out = []
    for (l, h), reg in sorted(regime.items()):
        others = [sensitivity[a, b] for (a, b), rr in regime.items() if rr == reg and (a, b) != (l, h)]
        scope = "regime"
        if len(others) < min_group:
            others = [sensitivity[a, b] for a in range(L) for b in range(H) if (a, b) != (l, h)]
            scope = "model"
        if not others:
            continue
        mu, sd = float(np.mean(others)), float(np.std(others))
        x = float(sensitivity[l, h])
        if x > 0 and x > mu + k * sd:
            out.append({"layer": l, "head": h, "regime": reg, "delta_ppl": x, "group_mean": mu, "group_std": sd,
                        "z": (x - mu) / sd if sd > 0 else float("inf"), "scope": scope})
    return sorted(out, key=lambda d: -d["delta_ppl"])


def critical_z(delta: np.ndarray, regimes: np.ndarray, min_group: int = 8) -> np.ndarray:
    """Leave-one-out z of every head's single-removal ΔPPL within its regime (the whole model when
    the regime has fewer than ``min_group`` other heads), as :func:`critical_heads`:
    ``delta [R, K]``, ``regimes [K]`` -> ``[R, K]`` (NaN where the others have no spread)."""
    delta = np.asarray(delta, dtype=np.float64)
    K = delta.shape[1]
    z = np.full(delta.shape, np.nan)
    groups = {}
    for r in np.unique(regimes):
        idx = np.nonzero(regimes == r)[0]
        groups[r] = idx if len(idx) - 1 >= min_group else np.arange(K)
    for k in range(K):
        idx = groups[regimes[k]]
        if len(idx) < 2:
            continue
        g = delta[:, idx]
        n = len(idx) - 1
        s = g.sum(1) - delta[:, k]
        q = (g * g).sum(1) - delta[:, k] ** 2
        mu = s / n
        sd = np.sqrt(np.maximum(q / n - mu * mu, 0))
        with np.errstate(invalid="ignore", divide="ignore"):
            z[:, k] = np.where(sd > 0, (delta[:, k] - mu) / np.where(sd > 0, sd, 1), np.nan)
    return z
