"""Attention sinks (SPEC §4): the corpus experiment (three passes per window: the unedited model
with :class:`~attngeom.sinks.reducer.SinkStats`, sink removal, the control removal), its tables and
its summary."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from attngeom.model.arguments import takes_handle
from attngeom.runs.contract import (ExperimentResult, ModelHandleLike, RunLike, check_scorable, layer_order, one_window_each,
                                    per_window_array, perplexity, window_records)
from attngeom.sinks.geometry import histogram_quantile, quadratic_fit_shape
from attngeom.stats import resampling
from attngeom.sinks.reducer import HISTOGRAMS, SinkStats
from attngeom.sinks.removal import SourceRemoval
from attngeom.sinks.settings import SinksSettings

# --------------------------------------------------------------------------------------------
# The corpus experiment
# --------------------------------------------------------------------------------------------

PASSES = ("none", "sink", "control")
PASS_SUFFIX = {"none": "base", "sink": "removed", "control": "control"}


@takes_handle
def window_work(handle: ModelHandleLike, windows, *, sink: int = 0, layers=None, removal_layers=None,
                batch_size: int = 2):
    """The per-unit work of the sinks experiment: ``work(units) -> record``.

    For the windows ``units``, three passes: the unedited model with :class:`SinkStats` (and the
    baseline :class:`SourceRemoval` statistics), sink removal and the control removal at
    ``removal_layers``. The record holds the reducers' additive states and the summed NLL and token
    count of each pass."""
    from attngeom.capture.session import Session
    from attngeom.streaming.passes import batch_nll, make_batches, scored_tokens

    session_layers = None
    if layers is not None and removal_layers is not None:
        session_layers = sorted(set(layers) | set(removal_layers))

    def work(units: list[int]) -> dict:
        stats = SinkStats(sink=sink, layers=layers)
        rec = {"nll": {}, "tokens": 0, "removal": {}}
        for mode in PASSES:
            removal = SourceRemoval(mode, sink=sink, layers=removal_layers)
            session = Session(observers=[stats] if mode == "none" else [], intervention=removal,
                              layers=session_layers)
            nll = 0.0
            for batch in make_batches(handle, [windows[u] for u in units], batch_size, index=units):
                if mode == "none":
                    stats.begin(batch)
                nll += float(batch_nll(handle, batch, session).sum())
                if mode == "none":
                    stats.end(batch)
                    rec["tokens"] += scored_tokens(batch)
            rec["nll"][mode] = nll
            rec["removal"][mode] = removal.state()
        rec["stats"] = stats.state()
        return rec

    return work


def results_from(merged: dict, *, sink: int = 0, layers=None, removal_layers=None) -> dict[str, pd.DataFrame]:
    """Tables of the experiment from the merged records: ``heads`` (SinkStats heads with the
    removal effects as ``*_base``/``*_removed``/``*_control`` columns), ``curve``, ``drift``,
    ``hist``, ``removal`` (per pass, layer and head) and ``ppl`` (per pass)."""
    res = SinkStats(sink=sink, layers=layers).load_state(merged["stats"]).result()
    removal = pd.concat([SourceRemoval(m, sink=sink, layers=removal_layers).load_state(merged["removal"][m]).result()
                         for m in PASSES], ignore_index=True)
    heads = res["heads"]
    if len(removal):
        wide = removal.pivot_table(index=["layer", "head"], columns="mode",
                                   values=["output_norm", "log_output_norm", "cone", "cos_output_semantic",
                                           "removed_mass", "output_norm_sink_heavy", "cone_sink_heavy",
                                           "layer_output_norm"])
        wide.columns = [f"{v}_{PASS_SUFFIX[m]}" for v, m in wide.columns]
        heads = heads.merge(wide.reset_index(), on=["layer", "head"], how="left")
    n = int(merged["tokens"])
    ppl = {m: perplexity(merged["nll"][m], n) for m in PASSES}
    ppl_df = pd.DataFrame([{"pass": m, "nll": float(merged["nll"][m]), "tokens": n, "ppl": ppl[m],
                            "delta_ppl": ppl[m] - ppl["none"]} for m in PASSES])
    return {"heads": heads, "curve": res["curve"], "drift": res["drift"], "hist": res["hist"],
            "removal": removal, "ppl": ppl_df}


def _f(x) -> float | None:
    x = float(x)
    return None if not np.isfinite(x) else x


def resampled_statistics(heads: dict[str, np.ndarray], ppl: dict[str, np.ndarray], cos_v0_m_counts: np.ndarray) -> dict[str, np.ndarray]:
    """The model-level numbers of the sinks experiment, written once for :func:`summarize` (one
    sample, ``R = 1``) and :func:`resampled` (``R`` resamples): from per-head values ``heads[name]
    [R, K]`` (``K`` = layers × heads: ``value_norm_ratio_raw``, ``value_norm_ratio_projected``,
    ``cos_v0_m_median``, ``rho_star_median``, ``fit_convex``, ``fit_vertex_interior`` and, per pass
    suffix ``base``/``removed``/``control``, ``output_norm_*``, ``cone_*``, ``cone_sink_heavy_*``),
    the perplexity of each pass ``ppl[pass] [R]`` (:data:`PASSES`) and the histogram counts of
    ``cos(ṽ_0, m_i)`` pooled over heads ``[R, bins + 2]``. Each value is an array ``[R]``: medians
    and means over heads ignore NaN, shares count the heads (SPEC §4)."""
    h = heads
    lo, hi, _ = HISTOGRAMS["cos_v0_m"]
    rho = h["rho_star_median"]
    with np.errstate(invalid="ignore", divide="ignore"):
        out = {
            "value_norm_ratio_raw": resampling.nanmedian_rows(h["value_norm_ratio_raw"]),
            "value_norm_ratio_projected": resampling.nanmedian_rows(h["value_norm_ratio_projected"]),
            "anti_aligned_share": (h["cos_v0_m_median"] < 0).mean(1),
            "cos_v0_m_pooled_median": histogram_quantile(cos_v0_m_counts, lo, hi, 0.5),
            "fit_convex_share": h["fit_convex"].mean(1),
            "fit_vertex_interior_share": h["fit_vertex_interior"].mean(1),
            "rho_star_median_interior_share": ((rho > 0) & (rho < 1)).mean(1),
            "removal_output_norm_ratio": resampling.nanmedian_rows(h["output_norm_removed"] / h["output_norm_base"]),
            "control_output_norm_ratio": resampling.nanmedian_rows(h["output_norm_control"] / h["output_norm_base"]),
        }
        for suffix in PASS_SUFFIX.values():
            out[f"cone_{suffix}"] = resampling.nanmean_rows(h[f"cone_{suffix}"])
        for suffix in PASS_SUFFIX.values():
            out[f"cone_sink_heavy_{suffix}"] = resampling.nanmean_rows(h[f"cone_sink_heavy_{suffix}"])
        out["cone_sink_heavy_change"] = out["cone_sink_heavy_removed"] - out["cone_sink_heavy_base"]
        out["cone_change"] = out["cone_removed"] - out["cone_base"]
        out["ppl"] = ppl["none"]
        out["removal_delta_ppl"] = ppl["sink"] - ppl["none"]
        out["control_delta_ppl"] = ppl["control"] - ppl["none"]
    return out


def _pooled_counts(hist: pd.DataFrame, quantity: str) -> np.ndarray:
    """The ``hist`` table's counts of ``quantity`` pooled over heads: ``[bins + 2]`` (under- and
    overflow bins first and last), as :func:`~attngeom.sinks.geometry.histogram_quantile` reads them."""
    lo, hi, bins = HISTOGRAMS[quantity]
    sub = hist[hist.quantity == quantity]
    width = (hi - lo) / bins
    counts = np.zeros(bins + 2)
    for blo, c in zip(sub.bin_lo, sub["count"]):
        k = 0 if not np.isfinite(blo) else int(round((blo - lo) / width)) + 1
        counts[min(k, bins + 1)] += c
    return counts


# summary.json's name of each number of :func:`resampled_statistics`
_SUMMARY_NAMES = {
    "value_norm_ratio_projected": "value_norm_ratio", "value_norm_ratio_raw": "raw_value_norm_ratio",
    "anti_aligned_share": "anti_aligned_share", "cos_v0_m_pooled_median": "cos_v0_m_median",
    "rho_star_median_interior_share": "interior_minimum_share",
}


def summarize(heads: pd.DataFrame, hist: pd.DataFrame, ppl: pd.DataFrame, drift: pd.DataFrame | None = None) -> dict:
    """Per-model summary numbers (medians/means over heads; shares are over heads): those of
    :func:`resampled_statistics` on the tables (one sample) and the descriptive ones only the tables hold
    (decomposition, entropy bins, the other pooled medians).

    Recomputable from an output directory: ``summarize(*(pd.read_parquet(out / f"{t}.parquet") for t
    in ("heads", "hist", "ppl", "drift")))``."""
    h = heads
    pp = ppl.set_index("pass")

    def pooled_median(q):
        lo, hi, _ = HISTOGRAMS[q]
        return histogram_quantile(_pooled_counts(hist, q), lo, hi, 0.5)

    columns = {"value_norm_ratio_raw": "raw_value_norm_ratio", "value_norm_ratio_projected": "value_norm_ratio",
               "cos_v0_m_median": "cos_v0_m_median", "rho_star_median": "rho_star_median",
               "fit_convex": "fit_convex", "fit_vertex_interior": "fit_vertex_interior"}
    columns |= {f"{k}_{suffix}": f"{k}_{suffix}" for k in ("output_norm", "cone", "cone_sink_heavy")
                for suffix in PASS_SUFFIX.values()}
    per_head = {name: h[col].to_numpy()[None] for name, col in columns.items()}
    stats = resampled_statistics(per_head, {m: np.array([pp.loc[m, "ppl"]]) for m in PASSES},
                       _pooled_counts(hist, "cos_v0_m")[None])
    stat = {_SUMMARY_NAMES.get(k, k): _f(v[0]) for k, v in stats.items()}
    out = {
        "heads": int(len(h)),
        **{k: stat[k] for k in ("value_norm_ratio", "raw_value_norm_ratio", "anti_aligned_share", "cos_v0_m_median")},
        "cos_v0_vj_median": _f(pooled_median("cos_v0_vj")),
        "cos_v0_vj_anti_aligned_share": _f((h["cos_v0_vj_median"] < 0).mean()),
        "interior_minimum_share": stat["interior_minimum_share"],
        "rho_star_median": _f(pooled_median("rho_star")),
        "rho_star_interior_query_share": _f(np.average(h["rho_star_interior_share"].fillna(0), weights=h["queries"])
                                            if h["queries"].sum() else np.nan),
        "fit_convex_share": stat["fit_convex_share"],
        "fit_vertex_interior_share": stat["fit_vertex_interior_share"],
        "sink_rate_mean": _f(h["sink_rate"].mean()),
        "sink_contribution_mean": _f(h["sink_contribution"].mean()),
        "sink_negative_contribution_share": _f(h["sink_negative_share"].mean()),
        "decomposition": {
            part: {
                **{f"mean_{k}": _f(h[f"{part}_{k}"].mean()) for k in ("attention", "relative_norm", "cosine")},
                **{f"share_{k}": _f(h[f"{part}_share_{k}"].mean()) for k in ("attention", "relative_norm", "cosine")},
            }
            for part in ("sink", "tail")
        },
        "corr_sink_rate_entropy_mean": _f(h["corr_rho_entropy"].mean()),
        "cancel_median": _f(h["cancel"].median()),
        "norm_reduction_median": _f(h["norm_reduction"].median()),
        **{k: stat[k] for k in ("ppl", "removal_delta_ppl", "control_delta_ppl", "removal_output_norm_ratio",
                                "control_output_norm_ratio")},
        "removal_output_norm_increase_share": _f((h["output_norm_removed"] > h["output_norm_base"]).mean()),
        **{k: stat[k] for k in ("cone_base", "cone_removed", "cone_control", "cone_sink_heavy_base",
                                "cone_sink_heavy_removed", "cone_sink_heavy_control")},
        "removal_output_norm_ratio_sink_heavy": _f((h["output_norm_sink_heavy_removed"] / h["output_norm_sink_heavy_base"]).median()),
        "control_output_norm_ratio_sink_heavy": _f((h["output_norm_sink_heavy_control"] / h["output_norm_sink_heavy_base"]).median()),
        "cos_output_semantic_base": _f(h["cos_output_semantic_base"].mean()),
        "removed_mass_sink": _f(h["removed_mass_removed"].mean()),
        "removed_mass_control": _f(h["removed_mass_control"].mean()),
    }
    if drift is not None and len(drift):
        d = drift[drift.queries > 0]
        by = d.assign(w=d.sink_rate * d.queries).groupby("bin_lo")
        out["entropy_bins"] = [float(x) for x in sorted(d.bin_lo.unique())]
        out["sink_rate_by_entropy"] = [_f(x) for x in (by.w.sum() / by.queries.sum()).values]
        out["cancel_by_entropy_median"] = [_f(x) for x in d.groupby("bin_lo").cancel.median().values]
    return out


@takes_handle
def experiment(handle: ModelHandleLike, run: RunLike | None, windows,
               settings: SinksSettings = SinksSettings()) -> ExperimentResult:
    """The sinks experiment over ``windows`` as one stage (``sinks``) of ``run`` (resumable, shareable
    among processes), with ``settings`` (:class:`~attngeom.sinks.settings.SinksSettings`). Returns an
    :class:`~attngeom.runs.contract.ExperimentResult`: the tables of :func:`results_from`, ``summary``
    (:func:`summarize`) and, when every record covers one window (``batch_size=1``),
    ``per_window["records"]``: the records of :func:`window_work` in window order, the additive sums
    a bootstrap over windows resamples."""
    from attngeom.data.corpora import check_layers
    from attngeom.runs.run import fingerprint, merge_sums, run_or_in_memory
    from attngeom.streaming.passes import to_ids

    sink, batch_size = settings.sink, settings.batch_size
    layers, removal_layers = (check_layers(x, handle.num_layers) for x in (settings.layers, settings.removal_layers))

    ids = [to_ids(handle, w) for w in windows]
    check_scorable(sum(max(0, len(w) - 1) for w in ids), "the input")
    work = window_work(handle, ids, sink=sink, layers=layers, removal_layers=removal_layers, batch_size=batch_size)
    records = run_or_in_memory(run).stage("sinks", len(ids), work, group=batch_size, desc="sinks", unit="window",
                        fingerprints=[fingerprint(w) for w in ids])
    merged = merge_sums(records.values())
    tables = results_from(merged, sink=sink, layers=layers, removal_layers=removal_layers)
    summary = summarize(tables["heads"], tables["hist"], tables["ppl"], tables["drift"])
    per_window = {}
    recs = window_records(records)
    if recs is not None:
        per_window["records"] = recs
    return ExperimentResult("sinks", tables=tables, summary=summary, per_window=per_window,
                            settings=settings.record())


# --------------------------------------------------------------------------------------------
# The summary under resampling
# --------------------------------------------------------------------------------------------


def _sink_acc(stats: dict) -> dict:
    """The per-layer sums of a :class:`~attngeom.sinks.reducer.SinkStats` state: ``{layer: {key: array}}``
    (a state of one ``acc``, or of several parts each with its own ``acc``: merged, the first part
    holding a key wins)."""
    if "acc" in stats:
        return stats["acc"]
    out: dict = {}
    for part in stats.values():
        for layer, d in (part.get("acc") or {}).items():
            mine = out.setdefault(layer, {})
            for k, x in d.items():
                mine.setdefault(k, x)
    return out


def window_sums(records: Sequence[dict]) -> dict[str, np.ndarray]:
    """The additive sums :func:`resampled` reads, per window, from the records of :func:`window_work`
    (one window each): ``[W, L, H, ...]``."""
    keys = ("n_texts", "n_sources", "v0_norm_sum", "vj_norm_sum", "v0_raw_norm_sum", "vj_raw_norm_sum",
            "hist_cos_v0_m", "hist_rho_star", "fit", "n")
    out = {}
    accs = [_sink_acc(r["stats"]) for r in records]
    for k in keys:
        out[k] = per_window_array(accs, lambda a: [a[l][k] for l in layer_order(a)])
    for mode in ("none", "sink", "control"):
        for k in ("n", "output_norm", "cone", "heavy_n", "heavy_output_norm", "heavy_cone"):
            out[f"{mode}_{k}"] = per_window_array(records, lambda r: [r["removal"][mode]["acc"][l][k]
                                                            for l in layer_order(r["removal"][mode]["acc"])])
        out[f"nll_{mode}"] = per_window_array(records, lambda r: r["nll"][mode])
    out["tokens"] = per_window_array(records, lambda r: r["tokens"])
    return out


def resampled(per_window: dict, weights: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The sinks experiment's model-level numbers under resampling ``weights`` (bootstrap counts per
    window ``[R, W]``, :func:`attngeom.stats.resampling.resample_counts`; None: every window once,
    ``R = 1``), from its ``per_window`` records (``batch_size=1``): :func:`resampled_statistics` of the
    per-head values of the resampled sums, each a float64 array ``[R]``."""
    X = window_sums(one_window_each(per_window, "records", "sinks"))
    counts = resampling.counts_or_once(weights, len(X["tokens"]))
    summed = lambda k: resampling.resample_sums(counts, X[k])                    # noqa: E731
    n_resamples = counts.shape[0]

    def flat(x):
        return x.reshape(n_resamples, -1)

    with np.errstate(invalid="ignore", divide="ignore"):
        ns, nt = summed("n_sources"), summed("n_texts")
        ok = (ns > 0) & (nt > 0)
        raw = np.where(ok, (summed("vj_raw_norm_sum") / ns) / (summed("v0_raw_norm_sum") / nt), np.nan)
        proj = np.where(ok, (summed("vj_norm_sum") / ns) / (summed("v0_norm_sum") / nt), np.nan)
        hc = summed("hist_cos_v0_m")
        lo, hi, _ = HISTOGRAMS["cos_v0_m"]
        lo_r, hi_r, _ = HISTOGRAMS["rho_star"]
        convex, interior = quadratic_fit_shape(summed("fit"))
        heads = {"value_norm_ratio_raw": flat(raw), "value_norm_ratio_projected": flat(proj),
                 "cos_v0_m_median": flat(histogram_quantile(hc, lo, hi, 0.5)),
                 "rho_star_median": flat(histogram_quantile(summed("hist_rho_star"), lo_r, hi_r, 0.5)),
                 "fit_convex": flat(convex), "fit_vertex_interior": flat(interior)}
        for mode, suffix in PASS_SUFFIX.items():
            n, hn = summed(f"{mode}_n"), summed(f"{mode}_heavy_n")
            heads[f"output_norm_{suffix}"] = flat(np.where(n > 0, summed(f"{mode}_output_norm") / n, np.nan))
            heads[f"cone_{suffix}"] = flat(np.where(n > 0, summed(f"{mode}_cone") / n, np.nan))
            heads[f"cone_sink_heavy_{suffix}"] = flat(np.where(hn > 0, summed(f"{mode}_heavy_cone") / hn, np.nan))
        tok = summed("tokens")
        ppl = {m: perplexity(summed(f"nll_{m}"), tok) for m in PASSES}
    return resampled_statistics(heads, ppl, flat(hc).reshape(n_resamples, -1, hc.shape[-1]).sum(1))


# --------------------------------------------------------------------------------------------
# The command's summary.json: built here, and read back here for the report's headline
# --------------------------------------------------------------------------------------------


TABLES = ("heads", "curve", "drift", "hist", "removal", "ppl")
"""The tables ``attngeom sinks`` writes, in this order (``<name>.parquet``)."""


def run_summary(result: ExperimentResult, windows: Sequence, *, model: str, data: str, window: int,
                identity: dict) -> dict:
    """``summary.json`` of ``attngeom sinks`` from :func:`experiment`'s ``result`` on ``windows``:
    the input, the sink and layers, ``models`` (the model's name -> :func:`summarize`'s numbers), the
    run's ``identity`` and the tables' files. :func:`headline` reads the report's numbers from it."""
    s = result.settings
    return {"command": "sinks", "data": data, "window": window, "windows": len(windows),
            "tokens": int(sum(len(w) for w in windows)), "sink_position": s["sink"],
            "layers": "all" if s["layers"] is None else list(s["layers"]),
            "removal_layers": "all" if s["removal_layers"] is None else list(s["removal_layers"]),
            "models": {model: result.summary}, "settings": identity, "files": [f"{t}.parquet" for t in TABLES]}


def headline(summary: dict) -> list[tuple[str, str]]:
    """The headline numbers of ``attngeom sinks``' report from its :func:`run_summary` (a missing
    field raises)."""
    f, share = resampling.format_number, resampling.format_share
    m = next(iter(summary["models"].values()))
    return [("median value-norm ratio, non-sink / sink", f(m["value_norm_ratio"])),
            ("heads whose sink value is anti-aligned with the semantic tokens", share(m["anti_aligned_share"])),
            ("heads with an interior minimum of the output norm in the sink rate", share(m["interior_minimum_share"])),
            ("perplexity of the unedited model", f(m["ppl"])),
            ("ΔPPL, sink removed", f(m["removal_delta_ppl"], True)),
            ("ΔPPL, mass-matched control removed", f(m["control_delta_ppl"], True))]
