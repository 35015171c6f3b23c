"""Geometry of token selection (SPEC §5): one query, every head, measured and predicted
(:func:`analyse_query`), and the corpus reducer :class:`SelectionStats`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from attngeom.capture.blocks import Block
from attngeom.errors import InputError
from attngeom.streaming.reducers import InputBatch, Reducer
from attngeom.selection.settings import DISTANCES, POWERS, SelectionSettings
from attngeom.selection.prediction import best_small_n, predict_curves, sink_regime
from attngeom.selection.separation import default_ns, geometry, random_orders, topn_order, violated_bounds

# --------------------------------------------------------------------------------------------
# One query, every head: measured + predicted
# --------------------------------------------------------------------------------------------


@dataclass
class QueryResult:
    """Selection geometry of one query: long-format rows and the regime parameters of each head."""

    rows: dict[str, np.ndarray]
    regime: dict[str, np.ndarray]
    violations: int
    selections: int


@dataclass
class QueryGeometry:
    """:func:`query_geometry`'s results, on the device of the query's attention: ``groups`` of rows,
    one per (kind, distance) with its sizes and ``[H, K]`` float64 columns (:data:`COLUMNS`); the
    regime's ``[H]`` parameters and best small ``N``; the bound violations (a 0-d tensor)."""

    groups: list[tuple[str, str, list[int], dict[str, torch.Tensor]]]
    regime: dict[str, torch.Tensor]
    best_n: dict[str, torch.Tensor]
    violations: torch.Tensor
    selections: int
    heads: int


COLUMNS = ("P", "R", "F", "ginv", "rho_max", "rho_min", "F_std", "P_pred", "R_pred", "F_pred")
"""The numeric columns of a query's rows."""


def analyse_query(a: torch.Tensor, v: torch.Tensor, has_sink: bool, ns: Sequence[int] = POWERS,
                  distances: Sequence[str] = DISTANCES, repeats: int = 8, generator: torch.Generator | None = None,
                  predict: bool = True, max_lag: int = 256, small_n_max: int = 16,
                  dtype: torch.dtype = torch.float64, random_without_sink: bool = True) -> QueryResult:
    """Everything of SPEC §5 for one query: ``a [H, S]`` attention over the candidates (position
    order, the sink first when ``has_sink``), ``v [H, S, d]`` their values.

    Rows: one per (kind, distance, head, N) with P, R, F, GInv, ρ_max, ρ_min (random kinds: means over
    ``repeats``, plus ``F_std``), and the predicted P, R, F for the top-N kinds (NaN elsewhere).
    ``random_without_sink=False`` skips the random control drawn from the non-sink candidates.
    Computed on ``a``'s device (:func:`query_geometry`), then copied to the host once."""
    return on_host(query_geometry(a, v, has_sink, ns, distances, repeats, generator, predict, max_lag,
                                  small_n_max, dtype, random_without_sink))


def query_geometry(a: torch.Tensor, v: torch.Tensor, has_sink: bool, ns: Sequence[int] = POWERS,
                   distances: Sequence[str] = DISTANCES, repeats: int = 8, generator: torch.Generator | None = None,
                   predict: bool = True, max_lag: int = 256, small_n_max: int = 16,
                   dtype: torch.dtype = torch.float64, random_without_sink: bool = True) -> QueryGeometry:
    """:func:`analyse_query`'s results as tensors on ``a``'s device. The random orders are drawn on
    the host from ``generator`` (the same selections on every device) and moved to the device."""
    H, S, d = v.shape
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    a = a.to(dtype)
    v = v.to(dtype)
    y = a[..., None] * v
    sets = {"": (y, a, S)}
    if has_sink:
        sets["_nosink"] = (y[:, 1:], a[:, 1:], S - 1)
    ns_of = {suffix: default_ns(count, ns) for suffix, (_, _, count) in sets.items()}
    if not has_sink:
        ns_of["_nosink"] = ns_of[""]
    groups: list = []
    violations, selections = a.new_zeros((), dtype=torch.long), 0
    measured_topn: dict[str, dict] = {}

    def emit(kind, dist, res, ns_k, std=None, pred=None):
        nan = torch.full((H, len(ns_k)), float("nan"), dtype=torch.float64, device=a.device)
        cols = {key: res[key].double() for key in ("P", "R", "F", "ginv", "rho_max", "rho_min")}
        cols["F_std"] = nan if std is None else std.double()
        for key in ("P", "R", "F"):
            cols[f"{key}_pred"] = nan if pred is None else pred[key].double()
        groups.append((kind, dist, ns_k, cols))

    for suffix, (ys, aa, count) in sets.items():
        ns_k = ns_of[suffix]
        if not ns_k:
            continue
        reps = repeats if (suffix == "" or random_without_sink) else 0
        order_top = topn_order(aa)                                       # [H, S']
        orders = [order_top]
        if reps:
            orders.append(random_orders((reps * H,), count, generator).to(a.device))
        res = geometry(ys, torch.cat(orders, 0), ns_k, distances)
        for dist in distances:
            r = res[dist]
            violations = violations + violated_bounds(r, ns_k)
            selections += r["P"].numel()
            top = {k: x[:H] for k, x in r.items()}
            measured_topn[f"topn{suffix}/{dist}"] = top
            if reps:
                rnd = {k: x[H:].reshape(reps, H, -1).double().mean(0) for k, x in r.items()}
                std = r["F"][H:].reshape(reps, H, -1).double().std(0, unbiased=False)
                emit(f"random{suffix}", dist, rnd, ns_k, std=std)
        measured_topn[f"ns{suffix}"] = ns_k

    params = sink_regime(a, v, has_sink=has_sink, max_lag=max_lag)
    preds: dict = {}
    if predict:
        n_rest = S - 1 if has_sink else S
        preds = predict_curves(params, n_rest, ns_of[""], ns_of["_nosink"] if has_sink else [], distances, has_sink, dtype)
    for suffix in ("", "_nosink"):
        kind = f"topn{suffix}"
        if suffix == "_nosink" and not has_sink:
            src = ""
        else:
            src = suffix
        ns_k = ns_of[src] if src in ns_of else []
        if not ns_k or f"topn{src}/{distances[0]}" not in measured_topn:
            continue
        for dist in distances:
            pred = preds.get(kind, {}).get(dist) if predict else None
            emit(kind, dist, measured_topn[f"topn{src}/{dist}"], ns_k, pred=pred)
    best_n: dict[str, torch.Tensor] = {}
    for suffix in ("", "_nosink"):
        src = suffix if has_sink else ""
        ns_k = ns_of.get(src, [])
        if not ns_k:
            continue
        for dist in distances:
            key = f"topn{src}/{dist}"
            if key not in measured_topn:
                continue
            best_n[f"best_n_{dist}{suffix}"] = best_small_n(measured_topn[key]["F"], ns_k, small_n_max)
            if predict and f"topn{suffix}" in preds:
                best_n[f"best_n_pred_{dist}{suffix}"] = best_small_n(
                    preds[f"topn{suffix}"][dist]["F"], ns_k, small_n_max)
    return QueryGeometry(groups, params, best_n, violations, selections, H)


def on_host(g: QueryGeometry) -> QueryResult:
    """The rows and regime of :class:`QueryGeometry` as numpy, in three copies from the device (the
    numeric columns with the bound violations, the regime, the best sizes), whatever the number of
    groups."""
    H = g.heads
    rows: dict[str, np.ndarray] = {}
    values = [torch.stack([cols[c].reshape(-1) for c in COLUMNS]) for *_, cols in g.groups]
    flat = torch.cat(([torch.cat(values, 1).reshape(-1)] if values else []) + [g.violations.double().reshape(1)])
    flat = flat.cpu().numpy()                                                      # one copy
    violations = int(flat[-1])
    if g.groups:
        K = [len(ns_k) for _, _, ns_k, _ in g.groups]
        rows["kind"] = np.concatenate([np.full(H * k, kind, dtype=object) for (kind, _, _, _), k in zip(g.groups, K)])
        rows["distance"] = np.concatenate([np.full(H * k, dist, dtype=object) for (_, dist, _, _), k in zip(g.groups, K)])
        rows["head"] = np.concatenate([np.repeat(np.arange(H), k) for k in K])
        rows["N"] = np.concatenate([np.tile(np.asarray(ns_k), H) for _, _, ns_k, _ in g.groups])
        rows.update(zip(COLUMNS, flat[:-1].reshape(len(COLUMNS), -1)))
    else:
        rows = {k: np.array([]) for k in ("kind", "distance", "head", "N", *COLUMNS)}
    regime = dict(zip(g.regime, torch.stack([x.double() for x in g.regime.values()]).cpu().numpy()))
    regime["head"] = np.arange(H)
    if g.best_n:
        regime.update(zip(g.best_n, torch.stack(list(g.best_n.values())).cpu().numpy()))
    return QueryResult(rows=rows, regime=regime, violations=violations, selections=g.selections)


# --------------------------------------------------------------------------------------------
# The reducer
# --------------------------------------------------------------------------------------------


def _seed_of(*parts: int) -> int:
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFF)) * 1099511628211) % (1 << 61)
    return h


class SelectionStats(Reducer):
    """Selection geometry of SPEC §5 at chosen queries of every window, every layer and head.

    ``queries``: ``"last"`` (default: the last real token of each window), ``"all"`` (every query
    ``i >= 1``), or an integer ``k`` (a seeded sample of ``k`` queries per window, the last one
    always included). ``repeats`` random subsets per size (seeded from ``seed``, the window, the
    layer and the query, so results do not depend on batching). ``predict`` adds the sink-aware
    prediction. ``sink`` is the sink position (it is only treated as the sink when the query can see
    it). ``dtype``: the precision of the geometry (float32 by default; float64 for exact comparisons).
    ``random_without_sink``: also draw the random control from the non-sink candidates (default)."""

    STATE = ("frames", "regime_frames", "violations", "selections")

    def __init__(self, ns: Sequence[int] = SelectionSettings.ns, distances: Sequence[str] = SelectionSettings.distances,
                 repeats: int = SelectionSettings.repeats, seed: int = SelectionSettings.seed,
                 queries: str | int = SelectionSettings.queries, sink: int = SelectionSettings.sink,
                 predict: bool = SelectionSettings.predict, max_lag: int = SelectionSettings.max_lag,
                 small_n_max: int = SelectionSettings.small_n_max, dtype: torch.dtype = torch.float32,
                 random_without_sink: bool = SelectionSettings.random_without_sink):
        for dist in distances:
            if dist not in DISTANCES:
                raise InputError(f"unknown distance {dist!r}; choose from {', '.join(DISTANCES)}")
        if repeats < 0:
            raise InputError(f"repeats must be >= 0, got {repeats}")
        if not (queries in ("last", "all") or (isinstance(queries, int) and queries >= 1)):
            raise InputError(f"queries must be 'last', 'all' or a positive sample size, got {queries!r}")
        self.ns = sorted(set(int(n) for n in ns))
        self.distances = tuple(distances)
        self.repeats = int(repeats)
        self.seed = int(seed)
        self.queries = queries
        self.sink = int(sink)
        self.predict = bool(predict)
        self.max_lag = int(max_lag)
        self.small_n_max = int(small_n_max)
        self.dtype = dtype
        self.random_without_sink = bool(random_without_sink)
        self.frames: list[pd.DataFrame] = []
        self.regime_frames: list[pd.DataFrame] = []
        self.violations = 0
        self.selections = 0
        self._targets: list[set[int]] = []

    def begin(self, batch: InputBatch) -> None:
        super().begin(batch)
        self._targets = []
        for b, text in enumerate(batch.index):
            L = int(batch.lengths[b])
            if L < 2:
                self._targets.append(set())
            elif self.queries == "last":
                self._targets.append({L - 1})
            elif self.queries == "all":
                self._targets.append(set(range(1, L)))
            else:
                g = np.random.default_rng(_seed_of(self.seed, text, 7))
                k = min(int(self.queries), L - 1)
                pick = set(int(x) for x in g.choice(np.arange(1, L - 1), size=max(0, k - 1), replace=False)) if k > 1 else set()
                self._targets.append(pick | {L - 1})

    def observe(self, block: Block) -> None:
        B, H, Q, S = block.shape
        for b in range(B):
            ts = [t for t in self._targets[b] if block.q_start <= t < block.q_start + Q]
            for t in sorted(ts):
                qi = t - block.q_start
                idx, first = self._candidates(block, b, qi, t)
                if idx.numel() < 2:
                    continue
                has_sink = first == self.sink
                a = block.a[b, :, qi, idx]
                v = block.v[b][:, idx]
                text = self.batch.index[b]
                g = torch.Generator().manual_seed(_seed_of(self.seed, text, block.layer, t))
                res = analyse_query(a, v, has_sink, self.ns, self.distances, self.repeats, g,
                                    self.predict, self.max_lag, self.small_n_max, self.dtype,
                                    self.random_without_sink)
                self.violations += res.violations
                self.selections += res.selections
                n = len(res.rows["N"])
                df = pd.DataFrame(res.rows)
                df.insert(0, "query", np.full(n, t))
                df.insert(0, "layer", np.full(n, block.layer))
                df.insert(0, "window", np.full(n, text))
                self.frames.append(df)
                rg = pd.DataFrame(res.regime)
                rg.insert(0, "candidates", np.full(H, idx.numel()))
                rg.insert(0, "has_sink", np.full(H, has_sink))
                rg.insert(0, "query", np.full(H, t))
                rg.insert(0, "layer", np.full(H, block.layer))
                rg.insert(0, "window", np.full(H, text))
                self.regime_frames.append(rg)

    @staticmethod
    def _candidates(block: Block, b: int, qi: int, t: int) -> tuple[torch.Tensor, int]:
        """The block's columns query ``t`` (row ``qi`` of text ``b``) sees, and the first one's
        position. Causal (no mask): the columns up to ``t``, known without reading the device; under
        a mask (padding, a sliding window), read from it on the host."""
        kpos = block.k_positions
        if block.allowed is None:
            return torch.arange(min(t - block.k_start + 1, kpos.shape[0]), device=kpos.device), block.k_start
        idx = block.allowed[min(b, block.allowed.shape[0] - 1), 0, qi].nonzero().squeeze(-1)
        return idx, (block.k_start + int(idx[0].cpu()) if idx.numel() else -1)

    def result(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """``(selection rows, regime rows)``."""
        sel = pd.concat(self.frames, ignore_index=True) if self.frames else pd.DataFrame()
        reg = pd.concat(self.regime_frames, ignore_index=True) if self.regime_frames else pd.DataFrame()
        if len(sel):
            for c in ("kind", "distance"):
                sel[c] = sel[c].astype(str)
        return sel, reg
