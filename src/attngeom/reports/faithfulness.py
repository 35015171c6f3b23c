"""Figure of the faithfulness experiment: comprehensiveness and sufficiency curves per metric."""

from __future__ import annotations

import textwrap
from pathlib import Path

from attngeom.reports.common import COLUMN_WIDTH_IN, MIN_FONT_PT, SMALL_SAMPLE, save_figure  # sets the Agg backend first

import matplotlib.pyplot as plt
import pandas as pd

COLORS = {
    "attention": "#1f77b4",
    "value_weighted": "#ff7f0e",
    "output_normalized": "#2ca02c",
    "contribution": "#d62728",
    "contribution_inter": "#9467bd",
    "random": "#7f7f7f",
}
LABELS = {"comprehensiveness": "Comprehensiveness (top-k masked)", "sufficiency": "Sufficiency (bottom-k masked)"}
FONT = MIN_FONT_PT + 0.5


def plot(table: pd.DataFrame, path: str | Path, measure: str = "ppl", title: str | None = None,
         model: str | None = None) -> Path:
    """Two panels stacked at one column of a paper (:data:`~attngeom.reports.common.COLUMN_WIDTH_IN`;
    every text at least 7 pt at that size): comprehensiveness above, sufficiency below, change vs
    ratio per metric, one legend under both; ``random`` as the mean over seeds with a band from the
    lowest to the highest seed."""
    path = Path(path)
    ylabel = "ΔPPL (PPL′ − PPL clean)" if measure == "ppl" else "Δ accuracy"
    fig, axes = plt.subplots(2, 1, figsize=(COLUMN_WIDTH_IN, 5.6), dpi=150, sharex=True)
    for ax, mode in zip(axes, ("comprehensiveness", "sufficiency")):
        t = table[table["mode"] == mode]
        for metric, g in t.groupby("metric", sort=False):
            color = COLORS.get(metric)
            if metric == "random":
                agg = g.groupby("ratio")["change"].agg(["mean", "min", "max", "count"]).reset_index()
                n = int(g["seed"].nunique()) if "seed" in g else 1
                ax.plot(agg["ratio"], agg["mean"], color=color, ls="--", marker=".", label=f"random (mean, {n} seeds)")
                if n > 1:
                    ax.fill_between(agg["ratio"], agg["min"], agg["max"], color=color, alpha=0.25, lw=0,
                                    label="random (min–max over seeds)")
            else:
                g = g.sort_values("ratio")
                ax.plot(g["ratio"], g["change"], color=color, marker="o", ms=3, lw=1.2, label=metric)
        if measure == "ppl":
            ax.set_yscale("symlog", linthresh=1.0)
        ax.axhline(0.0, color="black", lw=0.6)
        ax.set_ylabel(ylabel, fontsize=FONT)
        better = "higher is more faithful" if mode == "comprehensiveness" else "lower is more faithful"
        if measure != "ppl":
            better = "lower is more faithful" if mode == "comprehensiveness" else "higher is more faithful"
        ax.set_title(f"{LABELS[mode]}\n{better}", fontsize=FONT)        # two lines: one column is narrow
        ax.tick_params(labelsize=FONT)
        ax.grid(alpha=0.3, which="both")
    axes[-1].set_xlabel("removal ratio r\n(share of sources masked per query)", fontsize=FONT)
    handles, labels = axes[0].get_legend_handles_labels()
    labels = [textwrap.fill(label, 22) for label in labels]
    if handles:
        fig.legend(handles, labels, fontsize=FONT, loc="lower center", ncol=2, frameon=False)
    if title is None and not table.empty:
        clean = float(table["clean"].iloc[0])
        units = int(table["units"].iloc[0])
        what = "PPL" if measure == "ppl" else "accuracy"
        noun = ("window" if measure == "ppl" else "example") + ("" if units == 1 else "s")
        model = model or (str(table["model"].iloc[0]) if "model" in table else "")
        model = f", {model}" if model else ""
        title = f"Faithfulness of token rankings{model}\n(clean {what} {clean:.4g}, {units} {noun})" + (
            f"\nfewer than {SMALL_SAMPLE} {noun}: an example, not an estimate" if units < SMALL_SAMPLE else "")
    if title:
        fig.suptitle(title, fontsize=FONT + 1)
    rows = sum(max(label.count("\n") + 1 for label in labels[k:k + 2]) for k in range(0, len(labels), 2))
    fig.tight_layout(rect=(0, 0.035 * rows + 0.01, 1, 1))
    return save_figure(fig, path, layout=False)


def render(out_dir, fmt: str = "png") -> list[Path]:
    """Draw the figure of the faithfulness run in ``out_dir`` from its ``table.parquet`` (and the
    measure and title of its ``summary.json``) in format ``fmt``; returns its path (none when the
    table is empty)."""
    import json

    out = Path(out_dir)
    table = pd.read_parquet(out / "table.parquet")
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    if table.empty:
        return []
    return [plot(table, out / f"faithfulness.{fmt}", measure=summary.get("measure", "ppl"), title=summary.get("title"),
                 model=(summary.get("settings") or {}).get("model_name"))]
