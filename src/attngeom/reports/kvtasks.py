"""Figure of ``attngeom kvtasks`` (PNG by default, any format matplotlib writes), drawn from
``summary.parquet`` in an output directory.

- ``kvtasks-accuracy`` — accuracy over all tasks against the compression ratio, two panels: the
  baselines (left) and the policies from the papers' geometry (right, with the best baseline at
  each ratio drawn again in black for reference); 95 % bootstrap intervals over examples (none
  below 10 examples); the full cache's accuracy as a dashed line in both. Every policy of a panel
  has its own colour and marker; the legends sit below the panels, off the data; the title names
  the model, the context length, the mode and the number of examples (from ``summary.json``), and
  the tasks whose full-cache accuracy is below the floor (:mod:`attngeom.kvcache.averages`), which
  the accuracy over all tasks counts.

Rerun on an existing directory with ``python -m attngeom.reports.kvtasks DIR [FORMAT]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from attngeom.reports.common import COLUMN_WIDTH_IN, sample_note, save_figure  # sets the Agg backend first

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd


LEGEND_ROW_IN = 0.16
"""The height of one legend row at 7 pt, in inches: the strip below the panels grows with the rows."""

MARKERS = ("o", "s", "^", "D", "v", "P", "X")
"""One more cue than colour, so that neighbouring lines differ in print too."""


def styles(n: int) -> list[tuple[tuple, str]]:
    """``n`` (colour, marker) pairs, no colour twice up to 20 (tab20's dark shades first, then its
    light ones), the markers cycling beside them."""
    colours = plt.get_cmap("tab20").colors
    return [(colours[2 * i % 20 + (i % 20 >= 10)], MARKERS[i % len(MARKERS)]) for i in range(n)]


def _line(ax, g: pd.DataFrame, **kw) -> None:
    g = g.sort_values("ratio")
    v, lo, hi = (g[c].to_numpy(float) for c in ("accuracy", "low", "high"))
    yerr = None if np.isnan(lo).all() else [v - lo, hi - v]
    ax.errorbar(g["ratio"], v, yerr=yerr, ms=3, capsize=1.5, lw=1, **{"marker": "o", **kw})


def context(out_dir) -> str:
    """Model, context length and mode of the run in ``out_dir``, from its ``summary.json`` ("" without one)."""
    import json

    try:
        s = json.loads((Path(out_dir) / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    parts = [str(s["model"])] if s.get("model") else []
    if s.get("length"):
        parts.append(f"{int(s['length']):,} tokens")
    if s.get("mode"):
        parts.append(str(s["mode"]))
    return ", ".join(parts)


def fig_accuracy(summary: pd.DataFrame, path: Path, run: str = "", kinds: dict[str, bool] | None = None) -> Path:
    """The accuracy figure; ``run`` (model, length, mode: :func:`context`) heads its title; ``kinds``:
    each policy's kind as its run recorded it (:func:`attngeom.kvcache.tasks.geometry_of`)."""
    from attngeom.kvcache.averages import FLOOR, floor_table
    from attngeom.kvcache.tasks import best_baselines, geometry_of, overall

    s = overall(summary)
    full = s.loc[s["policy"] == "full", "accuracy"]
    flags = geometry_of(s["policy"], kinds)
    best = best_baselines(summary, flags)
    panels = [[(p, g) for p, g in s[s["policy"] != "full"].groupby("policy") if flags[p] == geometry]
              for geometry in (False, True)]
    rows = max((len(panel) + 3) // 2 for panel in panels)    # two legend columns: the policies, full cache, best baseline
    legend_in = LEGEND_ROW_IN * rows + 0.08
    fig, axes = plt.subplots(1, 2, figsize=(2 * COLUMN_WIDTH_IN, 2.9 + legend_in), sharey=True)
    for ax, geometry, panel in zip(axes, (False, True), panels):
        for (policy, g), (colour, marker) in zip(panel, styles(len(panel))):
            _line(ax, g, label=policy, color=colour, marker=marker)
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
    axes[0].set_ylabel("accuracy (string match), all tasks", fontsize=8)
    n = int(s["examples"].max()) if len(s) else 0
    fig.suptitle((f"{run}: " if run else "") + f"{sample_note(n, 'examples')}; "
                 + ("95 % bootstrap intervals over examples" if not s["low"].isna().all() else "no intervals")
                 + ".\nCompression ratio: share of the cache removed after the prefill.\n" + below_floor(summary, FLOOR, floor_table),
                 fontsize=7)
    bottom = legend_in / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, 1))
    for ax in axes:                                          # each panel's legend in the strip below it, off the data
        box = ax.get_position()
        ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=((box.x0 + box.x1) / 2, bottom),
                  bbox_transform=fig.transFigure, frameon=False)
    return save_figure(fig, path, layout=False)


def below_floor(summary: pd.DataFrame, floor: float, floor_table) -> str:
    """The figure's words on the tasks whose full-cache accuracy is below ``floor``."""
    table = floor_table(summary, floor)
    below = table.loc[~table["discriminates"], "task"].tolist()
    return (f"Below the floor (full cache < {100 * floor:g} %), counted in all tasks: {', '.join(below)}." if below
            else f"No task below the floor (full cache < {100 * floor:g} %).")


def render(out_dir, fmt: str = "png") -> list[Path]:
    """Draw the figure from ``summary.parquet`` in ``out_dir`` in format ``fmt``; returns its path."""
    from attngeom.kvcache.tasks import recorded_geometry

    out = Path(out_dir)
    return [fig_accuracy(pd.read_parquet(out / "summary.parquet"), out / f"kvtasks-accuracy.{fmt}", context(out),
                         recorded_geometry(out))]


if __name__ == "__main__":  # pragma: no cover
    for p in render(sys.argv[1], *(sys.argv[2:3] or ["png"])):
        print(p)
