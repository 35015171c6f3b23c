"""``attngeom sinks``: attention sinks as active suppressors (SPEC §4).

Three passes over the corpus windows: the unedited model (statistics of :class:`~attngeom.sinks.SinkStats`
and the baseline perplexity), sink-norm removal, and the mass-matched control removal
(:class:`~attngeom.sinks.SourceRemoval`). Writes to ``--out``:

- ``heads.parquet`` — one row per (layer, head): sink rate and contribution, factor decomposition
  sink vs tail, value-norm ratios, anti-alignment quantiles, quadratic fit of the sink-rate / output
  norm relation and its vertex, ``ρ*`` quantiles, semantic-drift measures, and the removal effects
  (``*_base``, ``*_removed``, ``*_control``).
- ``curve.parquet`` — queries binned by sink rate (mean output norm, ...); ``drift.parquet`` —
  queries binned by the normalised entropy of the non-sink attention; ``hist.parquet`` — histograms
  of ``cos(ṽ_0, m_i)``, ``cos(ṽ_0, ṽ_j)`` and ``ρ*``; ``removal.parquet`` — per (pass, layer, head)
  output norms and cone measures; ``ppl.parquet`` — perplexity of each pass.
- ``summary.json`` and the figures of :mod:`attngeom.reports.sinks`.
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np
import pandas as pd
import torch

from ..errors import InputError
from . import common

PASSES = ("none", "sink", "control")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "sinks", help="attention sinks: anti-alignment, convex sink-rate/output-norm relation, removal",
        description="Check the contribution-weights paper's claims about attention sinks on a model: "
                    "value-norm ratios, anti-alignment cos(v0, m_i), the convex sink-rate / output-norm "
                    "relation and its minimiser rho*, semantic drift, and sink-norm removal (output norms, "
                    "cone measure, delta PPL) beside a mass-matched control.")
    common.add_model_args(p)
    common.add_data_args(p)
    p.add_argument("--layers", default=None, help="layers analysed, e.g. 0,5,10 (default: all)")
    p.add_argument("--removal-layers", default=None,
                   help="layers where the sink (and the control source) is removed (default: all)")
    p.add_argument("--sink", type=int, default=0, help="sink position (default 0, the BOS token)")
    p.add_argument("--batch-size", type=int, default=2, help="windows per forward pass (default 2)")
    p.add_argument("--no-figures", action="store_true", help="write tables and summary only")
    common.add_out_arg(p)
    p.set_defaults(func=run)


def _ppl(nll: float, n: int) -> float:
    return float(math.exp(nll / n)) if n else float("nan")


def run(args) -> int:
    from ..data import check_layers, load_windows, parse_int_list
    from ..sinks import SinkStats, SourceRemoval
    from ..trace import forward, make_batches, token_nll
    from ..capture import Session
    from tqdm.auto import tqdm

    common.check_at_least(args, window=3, max_windows=1, batch_size=1, sink=0)
    if args.window is not None and args.sink >= args.window - 1:
        raise InputError(f"--sink {args.sink} leaves no query after it in windows of {args.window} tokens")
    layers = parse_int_list(args.layers, "--layers")
    removal_layers = parse_int_list(args.removal_layers, "--removal-layers")
    out = common.prepare_out(args.out)
    t0 = time.time()
    handle = common.load(args)
    layers = check_layers(layers, handle.num_layers)
    removal_layers = check_layers(removal_layers, handle.num_layers)
    windows = load_windows(handle, args.data, args.window, args.stride, args.max_windows, common.fields_of(args))
    if all(len(w) <= args.sink + 1 for w in windows):
        raise InputError(f"no window is longer than the sink position {args.sink} + 1")
    session_layers = None
    if layers is not None and removal_layers is not None:
        session_layers = sorted(set(layers) | set(removal_layers))

    stats = SinkStats(sink=args.sink, layers=layers)
    recorders = {mode: SourceRemoval(mode, sink=args.sink, layers=removal_layers) for mode in PASSES}
    nll = {mode: 0.0 for mode in PASSES}
    ntok = {mode: 0 for mode in PASSES}
    labels = {"none": "unedited + statistics", "sink": "sink removed", "control": "control removed"}
    for mode in PASSES:
        session = Session(observers=[stats] if mode == "none" else [], intervention=recorders[mode],
                          layers=session_layers)
        bar = tqdm(total=len(windows), desc=f"sinks: {labels[mode]}", unit="window")
        for batch in make_batches(handle, windows, args.batch_size):
            if mode == "none":
                stats.begin(batch)
            logits = forward(handle, batch, session, logits=True)
            if mode == "none":
                stats.end(batch)
            x = token_nll(logits, batch)
            nll[mode] += float(x.double().sum())
            ntok[mode] += int((batch.lengths - 1).clamp_min(0).sum())
            del logits
            bar.update(len(batch.index))
        bar.close()

    res = stats.result()
    heads = res["heads"]
    removal = pd.concat([recorders[m].result() for m in PASSES], ignore_index=True)
    model_name = getattr(handle, "name", args.model)
    for df in (heads, res["curve"], res["drift"], res["hist"], removal):
        df.insert(0, "model", model_name)
    # removal effects next to the head statistics
    wide = removal.pivot_table(index=["layer", "head"], columns="mode",
                               values=["output_norm", "log_output_norm", "cone", "cos_output_semantic",
                                       "removed_mass", "output_norm_sink_heavy", "cone_sink_heavy",
                                       "layer_output_norm"])
    suffix = {"none": "base", "sink": "removed", "control": "control"}
    wide.columns = [f"{v}_{suffix[m]}" for v, m in wide.columns]
    wide = wide.reset_index()
    heads = heads.merge(wide, on=["layer", "head"], how="left")
    ppl_base = _ppl(nll["none"], ntok["none"])
    ppl_rows = [{"model": model_name, "pass": m, "nll": nll[m], "tokens": ntok[m], "ppl": _ppl(nll[m], ntok[m]),
                 "delta_ppl": _ppl(nll[m], ntok[m]) - ppl_base} for m in PASSES]
    ppl = pd.DataFrame(ppl_rows)

    common.write_parquet(heads, out / "heads.parquet")
    common.write_parquet(res["curve"], out / "curve.parquet")
    common.write_parquet(res["drift"], out / "drift.parquet")
    common.write_parquet(res["hist"], out / "hist.parquet")
    common.write_parquet(removal, out / "removal.parquet")
    common.write_parquet(ppl, out / "ppl.parquet")

    summary_model = summarise(heads, res["hist"], ppl, res["drift"])
    summary = {
        "command": "sinks",
        "data": args.data,
        "window": args.window,
        "windows": len(windows),
        "tokens": int(sum(len(w) for w in windows)),
        "sink_position": args.sink,
        "layers": layers if layers is not None else "all",
        "removal_layers": removal_layers if removal_layers is not None else "all",
        "models": {model_name: summary_model},
        "seconds": round(time.time() - t0, 1),
        "files": ["heads.parquet", "curve.parquet", "drift.parquet", "hist.parquet", "removal.parquet",
                  "ppl.parquet"],
    }
    if not args.no_figures:
        from ..reports.sinks import render

        summary["figures"] = [p.name for p in render(out)]
    common.write_json(out / "summary.json", summary)
    m = summary_model
    print(f"attngeom sinks: {model_name}: value-norm ratio (median) {m['value_norm_ratio']:.3g}, "
          f"anti-aligned heads {m['anti_aligned_share']:.1%}, interior rho* medians {m['interior_minimum_share']:.1%}, "
          f"delta PPL removal {m['removal_delta_ppl']:+.3g} / control {m['control_delta_ppl']:+.3g}; "
          f"written to {out}", file=sys.stderr)
    return 0


def _f(x) -> float | None:
    x = float(x)
    return None if not np.isfinite(x) else x


def summarise(heads: pd.DataFrame, hist: pd.DataFrame, ppl: pd.DataFrame, drift: pd.DataFrame | None = None) -> dict:
    """Per-model summary numbers (medians/means over heads; shares are over heads).

    Recomputable from an output directory: ``summarise(*(pd.read_parquet(out / f"{t}.parquet") for t
    in ("heads", "hist", "ppl", "drift")))``."""
    from ..sinks import HISTOGRAMS, histogram_quantile

    h = heads
    pp = ppl.set_index("pass")
    def pooled_median(q):
        lo, hi, bins = HISTOGRAMS[q]
        sub = hist[hist.quantity == q]
        width = (hi - lo) / bins
        counts = np.zeros(bins + 2)
        for blo, c in zip(sub.bin_lo, sub["count"]):
            k = 0 if not np.isfinite(blo) else int(round((blo - lo) / width)) + 1
            counts[min(k, bins + 1)] += c
        return histogram_quantile(counts, lo, hi, 0.5)

    base = h["output_norm_base"]
    out = {
        "heads": int(len(h)),
        "value_norm_ratio": _f(h["value_norm_ratio"].median()),
        "raw_value_norm_ratio": _f(h["raw_value_norm_ratio"].median()),
        "anti_aligned_share": _f(h["anti_aligned"].mean()),
        "cos_v0_m_median": _f(pooled_median("cos_v0_m")),
        "cos_v0_vj_median": _f(pooled_median("cos_v0_vj")),
        "cos_v0_vj_anti_aligned_share": _f((h["cos_v0_vj_median"] < 0).mean()),
        "interior_minimum_share": _f(h["rho_star_median_interior"].mean()),
        "rho_star_median": _f(pooled_median("rho_star")),
        "rho_star_interior_query_share": _f(np.average(h["rho_star_interior_share"].fillna(0), weights=h["queries"])),
        "fit_convex_share": _f(h["fit_convex"].mean()),
        "fit_vertex_interior_share": _f(h["fit_vertex_interior"].mean()),
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
        "ppl": _f(pp.loc["none", "ppl"]),
        "removal_delta_ppl": _f(pp.loc["sink", "delta_ppl"]),
        "control_delta_ppl": _f(pp.loc["control", "delta_ppl"]),
        "removal_output_norm_ratio": _f((h["output_norm_removed"] / base).median()),
        "control_output_norm_ratio": _f((h["output_norm_control"] / base).median()),
        "removal_output_norm_increase_share": _f((h["output_norm_removed"] > base).mean()),
        "cone_base": _f(h["cone_base"].mean()),
        "cone_removed": _f(h["cone_removed"].mean()),
        "cone_control": _f(h["cone_control"].mean()),
        "cone_sink_heavy_base": _f(h["cone_sink_heavy_base"].mean()),
        "cone_sink_heavy_removed": _f(h["cone_sink_heavy_removed"].mean()),
        "cone_sink_heavy_control": _f(h["cone_sink_heavy_control"].mean()),
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
