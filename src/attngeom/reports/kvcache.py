"""Figures of ``attngeom kvcache`` (PNG by default, any format matplotlib writes), drawn from
``summary.parquet`` in an output directory.

- ``kvcache-ppl`` — perplexity against the per-head budget, one line per policy with its 95 %
  bootstrap interval over windows (none on fewer than 10 windows); the full cache as a dashed line,
  its interval as a labelled grey band.
- ``kvcache-memory`` — peak cache memory against the budget, relative to the full cache (policies
  that keep the same number of entries share one line). Time per token is in ``summary.parquet``
  (``time_ratio``) and not drawn: on a shared CPU it is mostly noise.
- ``kvcache-answers`` (with ``answers-summary.parquet``) — greedy agreement with the full cache
  and the reference continuation's perplexity against the budget, with 95 % intervals.

Budgets are the ticks, written as plain numbers. Rerun on an existing directory with
``python -m attngeom.reports.kvcache DIR [FORMAT]``.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from attngeom.reports.common import figure_note, legend_outside, run_note, save_figure  # sets the Agg backend first

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

FULL = "full cache"


def _budget_axis(ax, budgets) -> None:
    """Log-2 budget axis with the budgets themselves as ticks (``64``, not ``2⁶``)."""
    b = sorted({int(x) for x in budgets})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(b))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("entries kept per key/value head (budget)")


def _style(summary: pd.DataFrame) -> dict:
    """policy -> (colour, marker): every policy its own, the same in every panel
    (:func:`attngeom.reports.kvtasks.styles`)."""
    from attngeom.reports.kvtasks import styles

    names = sorted(p for p in summary["policy"].unique() if p != "full")
    return dict(zip(names, styles(len(names))))


def _errorbars(ax, g: pd.DataFrame, col: str, label: str, style: tuple | None = None) -> None:
    lo, hi = g[f"{col}_low"].to_numpy(float), g[f"{col}_high"].to_numpy(float)
    v = g[col].to_numpy(float)
    yerr = None if np.isnan(lo).all() else [v - lo, hi - v]
    colour, marker = style if style is not None else (None, "o")
    ax.errorbar(g["budget"], v, yerr=yerr, marker=marker, color=colour, ms=3, capsize=2, lw=1.2, label=label)


def _windows_note(summary: pd.DataFrame) -> str:
    n = int(summary["windows"].max()) if "windows" in summary and len(summary) else 0
    shown = len(summary) and not summary["ppl_low"].isna().all()
    return f"{n} windows; " + ("95 % bootstrap intervals" if shown else "too few windows for intervals")


def fig_ppl(summary: pd.DataFrame, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    style = _style(summary)
    for policy, g in summary.groupby("policy"):
        g = g.sort_values("budget")
        if policy == "full":
            ax.axhline(g["ppl"].iloc[0], color="k", ls="--", lw=1, label=FULL)
            if np.isfinite(g["ppl_low"].iloc[0]):
                ax.axhspan(g["ppl_low"].iloc[0], g["ppl_high"].iloc[0], color="k", alpha=0.08,
                           label=f"{FULL}: 95 % interval")
            continue
        _errorbars(ax, g, "ppl", policy, style[policy])
    _budget_axis(ax, summary["budget"])
    ax.set_yscale("log")                    # plain tick numbers: reports.common.tidy_axes
    ax.set_ylabel("perplexity")
    ax.set_title(f"Perplexity under a KV-cache budget ({_windows_note(summary)})", fontsize=10)
    legend_outside(ax, fontsize=7)
    return save_figure(fig, path)


def fig_memory(summary: pd.DataFrame, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    s = summary[summary["policy"] != "full"]
    if "memory_saved" in s:
        lines: dict[tuple, list[str]] = {}
        for policy, g in s.groupby("policy"):
            g = g.sort_values("budget")
            key = tuple(np.round(1 - g["memory_saved"].to_numpy(float), 4)) + tuple(g["budget"])
            lines.setdefault(key, []).append(str(policy))
        for key, policies in lines.items():
            n = len(key) // 2
            label = ", ".join(policies) if len(policies) < 4 else f"{len(policies)} policies ({', '.join(policies)})"
            ax.plot(key[n:], key[:n], marker="o", ms=3, label=textwrap.fill(label, 60))
        ax.axhline(1, color="k", ls="--", lw=1, label=FULL)
        # below the axes: policies that keep the same entries share one long label
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    else:
        ax.text(0.5, 0.5, "no full-cache run to compare with", ha="center", va="center", transform=ax.transAxes)
    _budget_axis(ax, summary["budget"])
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("peak cache memory / full cache")
    ax.set_title("KV-cache memory against the budget", fontsize=10)
    return save_figure(fig, path)


def fig_answers(summary: pd.DataFrame, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    style = _style(summary)
    for policy, g in summary.groupby("policy"):
        g = g.sort_values("budget")
        for ax, col in zip(axes, ("match", "ref_ppl")):
            if policy == "full":
                ax.axhline(g[col].iloc[0], color="k", ls="--", lw=1, label=FULL)
                continue
            _errorbars(ax, g, col, policy, style[policy])
    axes[0].set_ylabel("greedy tokens equal to the full cache's")
    axes[0].set_title("Agreement with the full cache", fontsize=10)
    axes[1].set_ylabel("reference perplexity")
    axes[1].set_title("Perplexity of the reference continuation", fontsize=10)
    for ax in axes:
        _budget_axis(ax, summary["budget"])
    legend_outside(axes[1], fontsize=7)
    n = int(summary["examples"].max()) if "examples" in summary and len(summary) else 0
    fig.suptitle(f"Answers under a KV-cache budget ({n} examples)", fontsize=10)
    return save_figure(fig, path)


def render(out_dir, fmt: str = "png") -> list[Path]:
    """Draw every figure from ``summary.parquet`` (and ``answers-summary.parquet`` when there) in
    ``out_dir`` in format ``fmt``; returns their paths."""
    out = Path(out_dir)
    summary = pd.read_parquet(out / "summary.parquet")
    with figure_note(run_note(out)):
        paths = [fig_ppl(summary, out / f"kvcache-ppl.{fmt}"), fig_memory(summary, out / f"kvcache-memory.{fmt}")]
        if (out / "answers-summary.parquet").is_file():
            paths.append(fig_answers(pd.read_parquet(out / "answers-summary.parquet"), out / f"kvcache-answers.{fmt}"))
    return paths


if __name__ == "__main__":  # pragma: no cover
    for p in render(sys.argv[1], *(sys.argv[2:3] or ["png"])):
        print(p)
