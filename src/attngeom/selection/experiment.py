"""Geometry of token selection (SPEC §5): the corpus experiment and its summaries (the best small N,
the per-distance summary)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from attngeom.model.arguments import takes_handle
from attngeom.errors import InputError
from attngeom.stats import resampling
from attngeom.runs.contract import ExperimentResult, ModelHandleLike, RunLike
from attngeom.selection.settings import SelectionSettings
from attngeom.selection.reducer import SelectionStats


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------


def best_small_n_table(sel: pd.DataFrame, small_n_min: int = 2, small_n_max: int = 16) -> pd.DataFrame:
    """Per (window, layer, query, head, top-N kind, distance): the measured and the predicted best small N
    (largest F over ``small_n_min <= N <= small_n_max``, ties to the smaller N)."""
    d = sel[sel["kind"].isin(["topn", "topn_nosink"]) & (sel["N"] >= small_n_min) & (sel["N"] <= small_n_max)]
    keys = ["window", "layer", "query", "head", "kind", "distance"]
    d = d.sort_values(keys + ["N"], kind="mergesort")
    m = d.loc[d.groupby(keys, sort=False)["F"].idxmax(), keys + ["N"]].rename(columns={"N": "best_n"})
    if not d["F_pred"].notna().any():
        return m.assign(best_n_pred=np.nan)
    p = d.loc[d.groupby(keys, sort=False)["F_pred"].idxmax(), keys + ["N"]].rename(columns={"N": "best_n_pred"})
    return m.merge(p, on=keys)


def summarize(sel: pd.DataFrame, reg: pd.DataFrame, violations: int, selections: int,
              small_n_max: int = 16) -> dict:
    """The ``summary.json`` content: F per N (means over windows, queries, layers and heads) for
    top-N and random, with and without the sink, both distances; predictions; regime parameters."""
    out: dict = {"bound_violations": int(violations), "selections_checked": int(selections)}
    if not len(sel):
        return out
    W = int(sel["window"].max()) + 1
    columns = {"f_topn": "F", "p_topn": "P", "r_topn": "R", "f_predicted": "F_pred", "ginv_topn": "ginv"}
    for dist in sorted(sel["distance"].unique()):
        ns = sorted(int(n) for n in sel.loc[sel["distance"] == dist, "N"].unique())
        per_column = {col: column_means(sel, W, ns, dist, col) for col in set(columns.values())}
        block = {}
        for label, suffix in (("with_sink", ""), ("without_sink", "_nosink")):
            def per_n(col, kind):
                m = per_column[col].get(kind)
                return {} if m is None else {n: float(x) for n, x in zip(ns, m[0]) if not np.isnan(x)}

            block[label] = {key: per_n(col, f"topn{suffix}") for key, col in columns.items()}
            block[label]["f_random"] = per_n("F", f"random{suffix}")
            block[label] = {k: block[label][k] for k in ("f_topn", "f_random", "p_topn", "r_topn", "f_predicted",
                                                          "ginv_topn")}
        out[dist] = block
    if len(reg):
        def stat(col, fn="median"):
            x = reg[col].replace([np.inf, -np.inf], np.nan).dropna()
            return float(getattr(x, fn)()) if len(x) else None
        out["sink_regime"] = {
            "norm_ratio_median": stat("norm_ratio"),
            "norm_ratio_mean": stat("norm_ratio", "mean"),
            "norm_cv_median": stat("norm_cv"),
            "sink_cos_mean": stat("sink_cos", "mean"),
            "sink_cos_negative_share": float((reg["sink_cos"] < 0).mean()),
            "lambda_median": stat("lam"),
            "lambda_mae_mean": stat("lam_mae", "mean"),
            "cos_lag1_mean": stat("cos_lag1", "mean"),
            "cos_far_mean": stat("cos_far", "mean"),
            "sink_mass_mean": stat("sink_mass", "mean"),
            "middle_level_mean": stat("middle_level", "mean"),
            "recent_level_mean": stat("recent_level", "mean"),
            "recent_window_median": stat("recent_window"),
            "profile_r2_mean": stat("profile_r2", "mean"),
        }
        best = {}
        bt = best_small_n_table(sel, small_n_max=small_n_max)
        for (kind, dist), g in bt.dropna(subset=["best_n_pred"]).groupby(["kind", "distance"]):
            m, p = g["best_n"], g["best_n_pred"]
            best[f"{dist}_{'with_sink' if kind == 'topn' else 'without_sink'}"] = {
                "agreement": float((m == p).mean()),
                "measured_mode": int(m.mode().iloc[0]),
                "predicted_mode": int(p.mode().iloc[0]),
                "measured_share": {int(k): float(x) for k, x in m.value_counts(normalize=True).sort_index().items()},
                "predicted_share": {int(k): float(x) for k, x in p.value_counts(normalize=True).sort_index().items()},
            }
        out["best_small_n"] = {"small_n_min": 2, "small_n_max": small_n_max, **best}
    return out


def window_sums(sel: pd.DataFrame, n_windows: int, ns: Sequence[int], distance: str = "euclidean",
                 column: str = "F") -> dict:
    """Per-window sums of ``column`` (``F`` by default) and row counts of the ``selection`` rows at
    ``distance``: ``{kind: (sum [W, N], count [W, N])}`` for the kinds of
    :data:`attngeom.selection.separation.SELECTION_KINDS`."""
    d = sel[sel["distance"] == distance]
    out = {}
    ns = list(ns)
    for kind, g in d.groupby("kind"):
        s = np.zeros((n_windows, len(ns)))
        c = np.zeros((n_windows, len(ns)))
        agg = g.groupby(["window", "N"])[column].agg(["sum", "count"]).reset_index()
        for w, n, x, k in zip(agg["window"], agg["N"], agg["sum"], agg["count"]):
            if int(n) in ns and 0 <= int(w) < n_windows:
                s[int(w), ns.index(int(n))] += x
                c[int(w), ns.index(int(n))] += k
        out[str(kind)] = (s, c)
    return out


def column_means(sel: pd.DataFrame, n_windows: int, ns: Sequence[int], distance: str, column: str,
                 weights: np.ndarray | None = None) -> dict:
    """Mean of ``column`` per kind of selection and ``N`` under resampling ``weights`` (bootstrap
    counts per window ``[R, W]``; None: every window once): ``{kind: [R, len(ns)]}`` (NaN where a
    kind has no row). The one rule behind :func:`summarize` and :func:`resampled`."""
    counts = resampling.counts_or_once(weights, n_windows)
    X = window_sums(sel, n_windows, ns, distance, column)
    return {kind: resampling.ratio_of_sums(counts, s, c) for kind, (s, c) in X.items()}


def resampled(per_window: dict, weights: np.ndarray | None = None, distance: str = "euclidean") -> dict:
    """Mean ``F_N`` per kind of selection under resampling ``weights`` (bootstrap counts per window
    ``[R, W]``, :func:`attngeom.stats.resampling.resample_counts`; None: every window once, ``R = 1``),
    from the experiment's ``per_window`` (its ``selection`` rows and the number of ``windows``):
    ``{"ns": [N, ...], "mean_f": {kind: [R, len(ns)]}}`` (:func:`column_means`, as :func:`summarize`
    computes its means)."""
    sel, W = per_window["selection"], per_window["windows"]
    ns = sorted(int(n) for n in sel["N"].unique())
    return {"ns": ns, "mean_f": column_means(sel, W, ns, distance, "F", weights)}


# --------------------------------------------------------------------------------------------
# The corpus experiment
# --------------------------------------------------------------------------------------------


@takes_handle
def experiment(handle: ModelHandleLike, run: RunLike | None, windows,
               settings: SelectionSettings = SelectionSettings()) -> ExperimentResult:
    """Selection geometry over ``windows`` as one stage (``selection``) of ``run`` (resumable,
    shareable), with ``settings`` (:class:`~attngeom.selection.settings.SelectionSettings`): each record is
    the :class:`SelectionStats` state of its windows. Returns an
    :class:`~attngeom.runs.contract.ExperimentResult` with ``tables["selection"]`` and
    ``tables["regime"]`` (rows per window: the ``window`` column is what a bootstrap over windows
    resamples), ``summary`` (:func:`summarize`) and ``per_window``: the ``selection`` rows and the number
    of ``windows`` (what :func:`resampled` resamples)."""
    from attngeom.streaming.stages import reduce_stage

    options = settings.stats_options()
    (reducer,) = reduce_stage(handle, run, "selection", windows, lambda: [SelectionStats(**options)],
                              layers=settings.layers, batch_size=settings.batch_size)
    sel, reg = reducer.result()
    if not len(sel):
        raise InputError("no query had at least 2 candidate sources; use longer windows")
    summary = summarize(sel, reg, reducer.violations, reducer.selections, reducer.small_n_max)
    return ExperimentResult("selection", tables={"selection": sel, "regime": reg}, summary=summary,
                            per_window={"selection": sel, "windows": len(windows)}, settings=settings.record())


# --------------------------------------------------------------------------------------------
# The command's summary.json: built here, and read back here for the report's headline
# --------------------------------------------------------------------------------------------


TABLES = ("selection", "regime")
"""The tables ``attngeom selection`` writes, in this order (``<name>.parquet``)."""


def run_summary(result: ExperimentResult, windows: Sequence, *, model: str, data: str, window: int,
                identity: dict) -> dict:
    """``summary.json`` of ``attngeom selection`` from :func:`experiment`'s ``result`` on ``windows``:
    the input, the options, :func:`summarize`'s numbers, the run's ``identity`` and the tables'
    files. :func:`headline` reads the report's numbers from it."""
    s = result.settings
    return {"command": "selection", "model": model, "data": data, "window": window, "windows": len(windows),
            "tokens": int(sum(len(w) for w in windows)), "queries": s["queries"], "ns": list(s["ns"]),
            "distances": list(s["distances"]), "repeats": s["repeats"], "seed": s["seed"],
            "sink_position": s["sink"], "layers": "all" if s["layers"] is None else list(s["layers"]),
            **result.summary, "settings": identity, "files": [f"{t}.parquet" for t in TABLES]}


def headline(summary: dict) -> list[tuple[str, str]]:
    """The headline numbers of ``attngeom selection``'s report from its :func:`run_summary`: F_N of
    the top-N and random subsets (with the sink) per distance and N, and the bound violations (a
    missing field raises)."""
    f = resampling.format_number
    out = []
    for d in summary["distances"]:
        ws = summary[d]["with_sink"]
        for n in summary["ns"]:
            top, rnd = (ws[k].get(n, ws[k].get(str(n))) for k in ("f_topn", "f_random"))
            out.append((f"F_N at N = {n} ({d}): top-N / random", f"{f(top)} / {f(rnd)}"))
    out.append(("bound violations", str(summary["bound_violations"])))
    return out
