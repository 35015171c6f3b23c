"""Figures of ``attngeom kvcache`` (PNG, dpi 150), drawn from ``summary.parquet`` in an output directory.

- ``kvcache-ppl.png`` — perplexity against the per-head budget, one line per policy with its 95 %
  bootstrap interval over windows; the full cache as a dashed line with its band.
- ``kvcache-cost.png`` — peak cache memory and time per token against the budget, relative to the
  full cache.
- ``kvcache-answers.png`` (with ``answers-summary.parquet``) — greedy agreement with the full cache
  and the reference continuation's perplexity against the budget, with 95 % intervals.

Rerun on an existing directory with ``python -m attngeom.reports.kvcache DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from attngeom.reports.common import save_figure  # sets the Agg backend first

import matplotlib.pyplot as plt
import pandas as pd


def fig_ppl(summary: pd.DataFrame, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, g in summary.groupby("policy"):
        g = g.sort_values("budget")
        if policy == "full":
            ax.axhline(g["ppl"].iloc[0], color="k", ls="--", lw=1, label="full cache")
            ax.axhspan(g["ppl_low"].iloc[0], g["ppl_high"].iloc[0], color="k", alpha=0.08)
            continue
        ax.errorbar(g["budget"], g["ppl"], yerr=[g["ppl"] - g["ppl_low"], g["ppl_high"] - g["ppl"]],
                    marker="o", ms=3, capsize=2, lw=1.2, label=policy)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("entries per key/value head (budget)")
    ax.set_ylabel("perplexity (95% bootstrap over windows)")
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def fig_cost(summary: pd.DataFrame, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    s = summary[summary["policy"] != "full"]
    for policy, g in s.groupby("policy"):
        g = g.sort_values("budget")
        if "memory_saved" in g:
            axes[0].plot(g["budget"], 1 - g["memory_saved"], marker="o", ms=3, label=policy)
        if "time_ratio" in g:
            axes[1].plot(g["budget"], g["time_ratio"], marker="o", ms=3, label=policy)
    axes[0].set_ylabel("peak cache memory / full cache")
    axes[1].set_ylabel("time per token / full cache")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget")
        ax.axhline(1, color="k", ls="--", lw=1)
    if axes[1].get_legend_handles_labels()[0]:            # without the full cache there is nothing to compare
        axes[1].legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def fig_answers(summary: pd.DataFrame, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for policy, g in summary.groupby("policy"):
        g = g.sort_values("budget")
        for ax, col in zip(axes, ("match", "ref_ppl")):
            if policy == "full":
                ax.axhline(g[col].iloc[0], color="k", ls="--", lw=1, label="full cache")
                continue
            ax.errorbar(g["budget"], g[col], yerr=[g[col] - g[f"{col}_low"], g[f"{col}_high"] - g[col]],
                        marker="o", ms=3, capsize=2, lw=1.2, label=policy)
    axes[0].set_ylabel("greedy tokens equal to the full cache's")
    axes[1].set_ylabel("reference perplexity")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget")
    axes[1].legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def render(out_dir) -> list[Path]:
    """Draw every figure from ``summary.parquet`` (and ``answers-summary.parquet`` when there) in
    ``out_dir``; returns the PNG paths."""
    out = Path(out_dir)
    summary = pd.read_parquet(out / "summary.parquet")
    paths = [fig_ppl(summary, out / "kvcache-ppl.png"), fig_cost(summary, out / "kvcache-cost.png")]
    if (out / "answers-summary.parquet").is_file():
        paths.append(fig_answers(pd.read_parquet(out / "answers-summary.parquet"), out / "kvcache-answers.png"))
    return paths


if __name__ == "__main__":  # pragma: no cover
    for p in render(sys.argv[1]):
        print(p)
