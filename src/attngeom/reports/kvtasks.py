"""Figure of ``attngeom kvtasks`` (PNG by default, any format matplotlib writes), drawn from
``summary.parquet`` in an output directory.

- ``kvtasks-accuracy`` — accuracy over all tasks against the compression ratio, two panels: the
  baselines (left) and the policies from the papers' geometry (right, with the best baseline at
  each ratio drawn again in black for reference); 95 % bootstrap intervals over examples (none
  below 10 examples); the full cache's accuracy as a dashed line at ratio 0 in both.

Rerun on an existing directory with ``python -m attngeom.reports.kvtasks DIR [FORMAT]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from attngeom.reports.common import COLUMN_WIDTH_IN, save_figure  # sets the Agg backend first

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd


def _line(ax, g: pd.DataFrame, **kw) -> None:
    g = g.sort_values("ratio")
    v, lo, hi = (g[c].to_numpy(float) for c in ("accuracy", "low", "high"))
    yerr = None if np.isnan(lo).all() else [v - lo, hi - v]
    ax.errorbar(g["ratio"], v, yerr=yerr, marker="o", ms=2.5, capsize=1.5, lw=1, **kw)


def fig_accuracy(summary: pd.DataFrame, path: Path) -> Path:
    from attngeom.kvcache.policies import get_policy
    from attngeom.kvcache.tasks import best_baselines, overall

    s = overall(summary)
    full = s.loc[s["policy"] == "full", "accuracy"]
    best = best_baselines(summary)
    fig, axes = plt.subplots(1, 2, figsize=(2 * COLUMN_WIDTH_IN, 3.0), sharey=True)
    for ax, geometry in zip(axes, (False, True)):
        for policy, g in s[s["policy"] != "full"].groupby("policy"):
            if get_policy(policy).geometry == geometry:
                _line(ax, g, label=policy)
        if geometry and best:
            ref = pd.concat([s[(s["policy"] == p) & (s["ratio"] == r)] for r, p in best.items()])
            _line(ax, ref, label="best baseline", color="black")
        if len(full):
            ax.axhline(float(full.iloc[0]), color="grey", ls="--", lw=0.8, label="full cache")
        ax.set_xlabel("compression ratio", fontsize=8)
        ax.set_xticks(sorted(s.loc[s["ratio"] > 0, "ratio"].unique()))
        ax.tick_params(labelsize=7)
        ax.set_title("geometry policies" if geometry else "baselines", fontsize=9)
        ax.set_ylim(-0.03, 1.03)
        ax.legend(fontsize=7, ncol=2, loc="lower left", frameon=False)
    axes[0].set_ylabel("accuracy (string match), all tasks", fontsize=8)
    n = int(s["examples"].max()) if len(s) else 0
    fig.suptitle(f"Compression ratio: share of the cache removed after the prefill. {n} examples; "
                 + ("95 % bootstrap intervals" if not s["low"].isna().all() else "too few examples for intervals"),
                 fontsize=7)
    return save_figure(fig, path)


def render(out_dir, fmt: str = "png") -> list[Path]:
    """Draw the figure from ``summary.parquet`` in ``out_dir`` in format ``fmt``; returns its path."""
    out = Path(out_dir)
    return [fig_accuracy(pd.read_parquet(out / "summary.parquet"), out / f"kvtasks-accuracy.{fmt}")]


if __name__ == "__main__":  # pragma: no cover
    for p in render(sys.argv[1], *(sys.argv[2:3] or ["png"])):
        print(p)
