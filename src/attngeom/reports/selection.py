"""Figures of ``attngeom selection`` (PNG by default, any format matplotlib writes), drawn from ``selection.parquet`` and
``regime.parquet``:

- ``selection-f-vs-n.png`` — mean F_N against N (log scale), one panel per distance: top-N (solid)
  vs random subsets (dotted, ± one std over heads of the repeat means shaded), with the sink (dark)
  and without (light), and the sink-aware prediction (dashed) beside each measured top-N curve;
- ``selection-pr.png`` — mean precision and recall of the top-N against N, measured and predicted;
- ``selection-layers.png`` — per layer, F at small N for top-N vs random (with the sink), and the
  gap made by removing the sink;
- ``selection-sink-regime.png`` — per layer: value-norm ratio non-sink/sink, sink cosine, the
  fitted decay rate λ with its mean absolute error, and the attention profile levels.

Rerun on an existing directory with ``python -m attngeom.reports.selection DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from attngeom.reports.common import figure_note, legend_outside, run_note, save_figure  # sets the Agg backend first

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

C_SINK, C_NOSINK = "#1f4e9a", "#e07b00"



def _title(sel: pd.DataFrame) -> str:
    return str(sel["model"].iloc[0]) if "model" in sel and len(sel) else ""


def fig_f_vs_n(sel: pd.DataFrame, path: Path) -> Path:
    dists = [d for d in ("euclidean", "cosine") if d in set(sel["distance"])]
    fig, axes = plt.subplots(1, len(dists), figsize=(6.2 * len(dists), 4.6), squeeze=False)
    for ax, dist in zip(axes[0], dists):
        d = sel[sel["distance"] == dist]
        for suffix, color, label in (("", C_SINK, "with sink"), ("_nosink", C_NOSINK, "sink excluded")):
            top = d[d["kind"] == f"topn{suffix}"].groupby("N")
            rnd = d[d["kind"] == f"random{suffix}"].groupby("N")
            if len(top):
                m = top["F"].mean()
                ax.plot(m.index, m.values, "-o", color=color, ms=4, label=f"top-N, {label}")
                p = top["F_pred"].mean()
                if p.notna().any():
                    ax.plot(p.index, p.values, "--", color=color, lw=1.4, label=f"top-N predicted, {label}")
            if len(rnd):
                m, s = rnd["F"].mean(), rnd["F"].std()
                ax.plot(m.index, m.values, ":s", color=color, ms=3, label=f"random, {label}")
                ax.fill_between(m.index, (m - s).values, (m + s).values, color=color, alpha=0.08)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("selection size N")
        ax.set_ylabel(r"geometric $F_N$ (mean over windows, layers, heads)")
        ax.set_title(f"{dist} distance")
        ax.grid(alpha=0.3)
        legend_outside(ax, fontsize=7, loc="best")
    fig.suptitle(f"{_title(sel)}: separability of the top-N selection vs random subsets")
    return save_figure(fig, path)


def fig_pr(sel: pd.DataFrame, path: Path) -> Path:
    dists = [d for d in ("euclidean", "cosine") if d in set(sel["distance"])]
    fig, axes = plt.subplots(1, len(dists), figsize=(6.2 * len(dists), 4.2), squeeze=False)
    for ax, dist in zip(axes[0], dists):
        d = sel[(sel["distance"] == dist) & (sel["kind"] == "topn")].groupby("N")
        for col, color in (("P", "#2a9d8f"), ("R", "#c0392b")):
            m = d[col].mean()
            ax.plot(m.index, m.values, "-o", color=color, ms=4, label=f"{col}_N measured")
            p = d[f"{col}_pred"].mean()
            if p.notna().any():
                ax.plot(p.index, p.values, "--", color=color, label=f"{col}_N predicted")
        g = d["ginv"].mean()
        ax2 = ax.twinx()
        ax2.plot(g.index, g.values, ":", color="#777777", label="GInv_N (right)")
        ax2.set_yscale("symlog")
        ax2.set_ylabel("mean inversions GInv_N")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("selection size N")
        ax.set_ylabel("precision / recall (top-N, with sink)")
        ax.set_title(f"{dist} distance")
        ax.grid(alpha=0.3)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        legend_outside(ax, h1 + h2, l1 + l2, fontsize=7, loc="best")
    fig.suptitle(f"{_title(sel)}: precision and recall of the top-N selection")
    return save_figure(fig, path)


def fig_layers(sel: pd.DataFrame, path: Path, dist: str = "euclidean", ns=(2, 4, 8)) -> Path:
    d = sel[sel["distance"] == dist]
    ns = [n for n in ns if n in set(d["N"])]
    fig, axes = plt.subplots(1, max(1, len(ns)), figsize=(4.6 * max(1, len(ns)), 3.8), squeeze=False)
    for ax, n in zip(axes[0], ns):
        dn = d[d["N"] == n]
        for kind, style, color, label in (("topn", "-o", C_SINK, "top-N, with sink"),
                                          ("random", ":s", C_SINK, "random, with sink"),
                                          ("topn_nosink", "-o", C_NOSINK, "top-N, sink excluded"),
                                          ("random_nosink", ":s", C_NOSINK, "random, sink excluded")):
            m = dn[dn["kind"] == kind].groupby("layer")["F"].mean()
            if len(m):
                ax.plot(m.index, m.values, style, color=color, ms=3, label=label)
        ax.set_xlabel("layer")
        ax.set_ylabel(f"mean $F_{{{n}}}$ over heads")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"N = {n} ({dist})")
        ax.grid(alpha=0.3)
    legend_outside(axes[0][0], fontsize=7)
    fig.suptitle(f"{_title(sel)}: separability by layer")
    return save_figure(fig, path)


def fig_sink_regime(reg: pd.DataFrame, path: Path) -> Path:
    r = reg.replace([np.inf, -np.inf], np.nan)
    g = r.groupby("layer")
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    q = g["norm_ratio"]
    axes[0].plot(q.median().index, q.median().values, "-o", ms=3, color="#333333", label="median over heads")
    axes[0].fill_between(q.median().index, q.quantile(0.25).values, q.quantile(0.75).values, alpha=0.2, color="#333333",
                         label="inter-quartile range")
    axes[0].axhline(1, color="#999999", lw=0.8)
    axes[0].set_yscale("log")
    axes[0].set_ylabel(r"mean $\|v_j\|$ ($j>0$) / $\|v_0\|$")
    axes[0].set_title("value-norm ratio non-sink / sink")
    c = g["sink_cos"]
    axes[1].plot(c.mean().index, c.mean().values, "-o", ms=3, color="#c0392b", label=r"$\cos(v_0, v_j)$, mean")
    axes[1].fill_between(c.mean().index, c.quantile(0.25).values, c.quantile(0.75).values, alpha=0.2, color="#c0392b")
    cl = g["cos_lag1"].mean()
    cf = g["cos_far"].mean()
    axes[1].plot(cl.index, cl.values, "-", color="#2a9d8f", label=r"$\cos(v_j, v_{j+1})$")
    axes[1].plot(cf.index, cf.values, "--", color="#2a9d8f", label="cos at the largest lag")
    axes[1].axhline(0, color="#999999", lw=0.8)
    axes[1].set_ylabel("cosine")
    axes[1].set_title("value directions")
    legend_outside(axes[1], fontsize=7)
    lam = g["lam"].median()
    mae = g["lam_mae"].mean()
    axes[2].plot(lam.index, lam.values, "-o", ms=3, color="#6a3d9a", label=r"$\lambda$ (median over heads)")
    axes[2].set_yscale("log")
    axes[2].set_ylabel(r"$\lambda$ of $\exp(-\lambda|i-j|)$")
    ax2 = axes[2].twinx()
    ax2.plot(mae.index, mae.values, ":", color="#999999", label="mean abs. error (right)")
    ax2.set_ylabel("fit MAE")
    axes[2].set_title("cosine decay with position distance")
    h1, l1 = axes[2].get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    legend_outside(axes[2], h1 + h2, l1 + l2, fontsize=7)
    for col, color, label in (("sink_mass", "#333333", r"sink weight $a_0$"),
                              ("recent_level", "#e07b00", "recency level (per token)"),
                              ("middle_level", "#1f77b4", "middle level (per token)")):
        m = g[col].mean()
        axes[3].plot(m.index, m.values, "-o", ms=3, color=color, label=label)
    axes[3].set_yscale("log")
    axes[3].set_ylabel("attention weight")
    axes[3].set_title("piecewise attention profile")
    legend_outside(axes[3], fontsize=7)
    for ax in axes:
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    legend_outside(axes[0], fontsize=7)
    fig.suptitle(f"{_title(reg)}: sink-aware regime at the analysed queries")
    return save_figure(fig, path)


def render(out_dir: str | Path, fmt: str = "png", sel: pd.DataFrame | None = None,
           reg: pd.DataFrame | None = None) -> list[Path]:
    """Draw every figure from the tables in ``out_dir`` in format ``fmt``; returns their paths."""
    out = Path(out_dir)
    if sel is None:
        sel = pd.read_parquet(out / "selection.parquet")
    if reg is None:
        reg = pd.read_parquet(out / "regime.parquet")
    with figure_note(run_note(out)):
        paths = [fig_f_vs_n(sel, out / f"selection-f-vs-n.{fmt}"), fig_pr(sel, out / f"selection-pr.{fmt}"),
                 fig_layers(sel, out / f"selection-layers.{fmt}")]
        if len(reg):
            paths.append(fig_sink_regime(reg, out / f"selection-sink-regime.{fmt}"))
    return paths


if __name__ == "__main__":  # pragma: no cover
    for p in render(sys.argv[1]):
        print(p)
