"""Figures of ``attngeom heads`` (PNG by default, any format matplotlib writes), from ``heads.parquet``, ``removal.parquet`` and
``regimes_by_layer.parquet``:

- ``heads-regime-grid.png`` — layer x head grid coloured by regime (Retriever / Mixer / Reset), the
  cell's shade the share of the winning label, critical heads outlined; a second panel for the second
  corpus when there is one;
- ``heads-regimes-by-layer.png`` — regime shares per layer (stacked);
- ``heads-removal.png`` — held-out perplexity against retention for every removal order;
- ``heads-sensitivity.png`` — layer x head grid of the single-removal ΔPPL (calibration split).

Rerun on an existing directory with ``python -m attngeom.reports.heads DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from attngeom.reports.common import current_note, figure_note, legend_outside, run_note, save_figure  # sets the Agg backend first

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.patches import Patch, Rectangle

REGIMES = ("Retriever", "Mixer", "Reset")
REGIME_COLORS = {"Retriever": "#2a9d8f", "Mixer": "#c0392b", "Reset": "#3b5b92"}
SHARE = {"Retriever": "winner_self", "Mixer": "winner_sink", "Reset": "winner_other"}
ORDER_STYLE = {"taxonomy": ("#c0392b", "-o"), "weight": ("#1f77b4", "-s"), "entropy": ("#2a9d8f", "-^"),
               "random": ("#777777", ":x"), "sensitivity": ("#6a3d9a", "-d")}



def _title(df: pd.DataFrame) -> str:
    return str(df["model"].iloc[0]) if "model" in df and len(df) else ""


def _grid(ax, heads: pd.DataFrame, regime_col: str, share_suffix: str, title: str) -> None:
    L = int(heads["layer"].max()) + 1
    H = int(heads["head"].max()) + 1
    img = np.ones((H, L, 3))
    for r in heads.itertuples():
        reg = getattr(r, regime_col)
        share = float(getattr(r, SHARE[reg] + share_suffix))
        base = np.array(matplotlib.colors.to_rgb(REGIME_COLORS[reg]))
        t = 0.25 + 0.75 * min(1.0, max(0.0, (share - 1 / 3) / (2 / 3)))  # plurality share 1/3..1 -> light..full
        img[int(r.head), int(r.layer)] = 1 - t * (1 - base)
    ax.imshow(img, aspect="auto", origin="lower", interpolation="nearest")
    if "critical" in heads:
        for r in heads[heads["critical"]].itertuples():
            ax.add_patch(Rectangle((r.layer - 0.5, r.head - 0.5), 1, 1, fill=False, ec="black", lw=1.8))
    ax.set_xlabel("layer")
    ax.set_ylabel("head")
    ax.set_xticks(range(0, L, max(1, L // 15)))
    ax.set_yticks(range(H))
    ax.set_title(title)


def fig_regime_grid(heads: pd.DataFrame, path: Path) -> Path:
    two = "regime_corpus2" in heads
    L = int(heads["layer"].max()) + 1
    fig, axes = plt.subplots(1, 2 if two else 1, figsize=(max(6, 0.22 * L + 2.0) * (2 if two else 1), 4.2),
                             squeeze=False)
    _grid(axes[0][0], heads, "regime", "", "regime by source winner (first corpus)")
    if two:
        _grid(axes[0][1], heads, "regime_corpus2", "_corpus2", "second corpus")
    handles = [Patch(color=REGIME_COLORS[r], label=f"{r} ({(heads['regime'] == r).mean():.0%})") for r in REGIMES]
    if "critical" in heads and heads["critical"].any():
        handles.append(Patch(fill=False, ec="black", lw=1.8, label="individually critical"))
    note = current_note()                    # what the figure rests on: under the legend (laid out here)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, ha="left", va="bottom", color="#444444")
    foot = 0.05 if note else 0.0
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, foot))
    fig.suptitle(f"{_title(heads)}: head regimes (shade = share of the winning label)")
    fig.tight_layout(rect=(0, 0.07 + foot, 1, 1))
    return save_figure(fig, path, layout=False)


def fig_regimes_by_layer(by_layer: pd.DataFrame, path: Path) -> Path:
    corpora = list(dict.fromkeys(by_layer["corpus"]))
    fig, axes = plt.subplots(1, len(corpora), figsize=(6.5 * len(corpora), 3.8), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        d = by_layer[by_layer["corpus"] == corpus].sort_values("layer")
        bottom = np.zeros(len(d))
        for r in REGIMES:
            ax.bar(d["layer"], d[r], bottom=bottom, color=REGIME_COLORS[r], label=r, width=0.85)
            bottom += d[r].to_numpy()
        ax.set_xlabel("layer")
        ax.set_ylabel("share of the layer's heads")
        ax.set_ylim(0, 1)
        ax.set_title(Path(str(corpus)).name)
        legend_outside(ax, fontsize=7, loc="upper right")
    fig.suptitle(f"{_title(by_layer)}: regime shares by layer depth")
    return save_figure(fig, path)


def fig_removal(curves: pd.DataFrame, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    for name, d in curves.groupby("order", sort=False):
        d = d.sort_values("retention")
        color, style = ORDER_STYLE.get(name, ("#333333", "-o"))
        ax.plot(d["retention"], d["ppl"], style, color=color, ms=5, label=name)
    base = curves[curves["retention"] >= 100]["ppl"]
    if len(base):
        ax.axhline(float(base.iloc[0]), color="#999999", lw=0.8, ls="--", label="all heads")
    ax.set_yscale("log")
    ax.invert_xaxis()
    ax.set_xlabel("heads retained (%)")
    ax.set_ylabel("held-out perplexity (log scale)")
    ax.grid(alpha=0.3, which="both")
    legend_outside(ax, fontsize=8, title="removal order", title_fontsize=8)
    ax.set_title(f"{_title(curves)}: perplexity against head retention")
    return save_figure(fig, path)


def fig_sensitivity(heads: pd.DataFrame, path: Path) -> Path:
    L = int(heads["layer"].max()) + 1
    H = int(heads["head"].max()) + 1
    m = np.full((H, L), np.nan)
    for r in heads.itertuples():
        m[int(r.head), int(r.layer)] = r.single_delta_ppl
    fig, ax = plt.subplots(figsize=(max(6, 0.32 * L + 2.5), 4.0))
    lim = np.nanmax(np.abs(m)) or 1.0
    cmap = LinearSegmentedColormap.from_list("bwr2", ["#2166ac", "#f7f7f7", "#b2182b"])
    im = ax.imshow(m, aspect="auto", origin="lower", cmap=cmap, norm=matplotlib.colors.SymLogNorm(
        linthresh=max(lim * 1e-3, 1e-3), vmin=-lim, vmax=lim))
    if "critical" in heads:
        for r in heads[heads["critical"]].itertuples():
            ax.add_patch(Rectangle((r.layer - 0.5, r.head - 0.5), 1, 1, fill=False, ec="black", lw=1.8))
    fig.colorbar(im, ax=ax, label="ΔPPL of removing the head alone (symlog)")
    ax.set_xlabel("layer")
    ax.set_ylabel("head")
    ax.set_yticks(range(H))
    ax.set_title(f"{_title(heads)}: single-head sensitivity\n(calibration split; critical heads outlined)")
    return save_figure(fig, path)


def render(out_dir: str | Path, fmt: str = "png", heads: pd.DataFrame | None = None,
           curves: pd.DataFrame | None = None, by_layer: pd.DataFrame | None = None) -> list[Path]:
    """Draw every figure from the tables in ``out_dir`` in format ``fmt``; returns their paths."""
    out = Path(out_dir)
    heads = pd.read_parquet(out / "heads.parquet") if heads is None else heads
    curves = pd.read_parquet(out / "removal.parquet") if curves is None else curves
    by_layer = pd.read_parquet(out / "regimes_by_layer.parquet") if by_layer is None else by_layer
    with figure_note(run_note(out)):
        return [fig_regime_grid(heads, out / f"heads-regime-grid.{fmt}"),
                fig_regimes_by_layer(by_layer, out / f"heads-regimes-by-layer.{fmt}"),
                fig_removal(curves, out / f"heads-removal.{fmt}"),
                fig_sensitivity(heads, out / f"heads-sensitivity.{fmt}")]


if __name__ == "__main__":  # pragma: no cover
    for p in render(sys.argv[1]):
        print(p)
