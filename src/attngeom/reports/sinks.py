"""Figures of ``attngeom sinks`` (PNG by default, any format matplotlib writes), drawn from the tables in an output directory.

``render(out_dir)`` reads ``heads/curve/drift/hist/removal/ppl.parquet`` and writes

- ``sinks-convexity.png`` — sink rate vs head output norm for the heads with the most sink attention:
  binned means (± std), the least-squares quadratic over the queries and its vertex, the median ``ρ*``;
- ``sinks-rho-star.png`` — distribution of the per-query minimiser ``ρ*`` (all heads) and, per layer,
  the share of heads whose median ``ρ*`` lies in (0, 1);
- ``sinks-anti-alignment.png`` — per layer, each head's median ``cos(ṽ_0, m_i)`` and ``cos(ṽ_0, ṽ_j)``;
- ``sinks-decomposition.png`` — the three factors of the contribution for the sink and the tail
  (levels and variance shares of ``log|c|``);
- ``sinks-removal.png`` — head output norms and cone measure per layer for the unedited model, sink
  removal and the control, and the change in perplexity;
- ``sinks-drift.png`` — sink rate and the sink's cancellation of the semantic mean against the
  normalised entropy of the non-sink attention.

Rerun on an existing directory with ``python -m attngeom.reports.sinks DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from attngeom.reports.common import figure_note, legend_outside, run_note, save_figure  # sets the Agg backend first

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

COLORS = {"base": "#333333", "removed": "#d62728", "control": "#1f77b4", "sink": "#d62728", "tail": "#1f77b4"}



def _model_title(df: pd.DataFrame) -> str:
    return str(df["model"].iloc[0]) if "model" in df and len(df) else ""


def fig_convexity(heads: pd.DataFrame, curve: pd.DataFrame, path: Path, n: int = 6) -> Path:
    spread = heads[(heads.rho_max - heads.rho_min) >= 0.3]
    pick = (spread if len(spread) >= 1 else heads).sort_values("sink_rate", ascending=False).head(n)
    cols = min(3, max(1, len(pick)))
    rows = int(np.ceil(len(pick) / cols)) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(pick):]:
        ax.axis("off")
    for ax, (_, r) in zip(axes.flat, pick.iterrows()):
        c = curve[(curve["layer"] == r["layer"]) & (curve["head"] == r["head"]) & (curve["queries"] > 0)]
        x = (c.bin_lo + c.bin_hi) / 2
        ax.errorbar(x, c.output_norm, yerr=c.output_norm_std, fmt="none", ecolor="#999999", lw=0.8)
        sizes = 10 + 120 * c.queries / max(c.queries.max(), 1)
        ax.scatter(x, c.output_norm, s=sizes, color="#333333", zorder=3, label=r"binned mean $\|o_i\|$")
        if np.isfinite(r.fit_alpha):
            g = np.linspace(0, 1, 200)
            inside = (g >= r.rho_min) & (g <= r.rho_max)
            yfit = r.fit_alpha * g**2 + r.fit_beta * g + r.fit_gamma
            ax.plot(g[inside], yfit[inside], color="#d62728", lw=2, label=f"quadratic fit (R²={r.fit_r2:.2f})")
            ax.plot(g, yfit, color="#d62728", lw=1, ls=":", alpha=0.7)
            if r.fit_convex and np.isfinite(r.fit_vertex):
                vy = r.fit_alpha * r.fit_vertex**2 + r.fit_beta * r.fit_vertex + r.fit_gamma
                if -0.2 <= r.fit_vertex <= 1.2:
                    ax.plot([r.fit_vertex], [vy], marker="v", color="#d62728", ms=9, ls="none",
                            label=f"vertex $\\rho$={r.fit_vertex:.2f}")
        if np.isfinite(r.rho_star_median):
            ax.axvline(np.clip(r.rho_star_median, 0, 1), color="#1f77b4", ls="--", lw=1.2,
                       label=f"median $\\rho^*$={r.rho_star_median:.2f}")
        ax.set_xlim(-0.02, 1.02)
        lo = np.nanmin(c.output_norm - c.output_norm_std.fillna(0)) if len(c) else 0
        hi = np.nanmax(c.output_norm + c.output_norm_std.fillna(0)) if len(c) else 1
        ax.set_ylim(max(0, lo - 0.1 * (hi - lo)), hi + 0.15 * (hi - lo))
        ax.set_title(f"layer {int(r['layer'])}, head {int(r['head'])} (mean $\\rho$={r.sink_rate:.2f})", fontsize=10)
        ax.set_xlabel(r"sink rate $\rho = a_{i0}$")
        ax.set_ylabel(r"head output norm $\|o_i^h\|$")
        legend_outside(ax, fontsize=7, loc="best")
    fig.suptitle(f"{_model_title(heads)}: sink rate vs head output norm (heads with the most sink attention)",
                 fontsize=11)
    return save_figure(fig, path)


def _pooled_hist(hist: pd.DataFrame, quantity: str, lo: float, hi: float, width: float):
    sub = hist[hist.quantity == quantity]
    edges = np.arange(lo, hi + width / 2, width)
    counts = np.zeros(len(edges) - 1)
    below = above = 0.0
    for blo, c in zip(sub.bin_lo.to_numpy(), sub["count"].to_numpy()):
        if not np.isfinite(blo) or blo < lo:
            below += c
        elif blo >= hi:
            above += c
        else:
            counts[min(int((blo - lo + 1e-9) // width), len(counts) - 1)] += c
    return edges, counts, below, above


def fig_rho_star(heads: pd.DataFrame, hist: pd.DataFrame, path: Path) -> Path:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    edges, counts, below, above = _pooled_hist(hist, "rho_star", -1.0, 2.0, 0.02)
    total = counts.sum() + below + above
    if total > 0:
        a1.bar(edges[:-1], counts / total, width=np.diff(edges), align="edge", color="#1f77b4", alpha=0.8)
    a1.axvspan(0, 1, color="#2ca02c", alpha=0.08, label="interior (0, 1)")
    a1.set_xlabel(r"per-query minimiser $\rho^*$ of $\|\rho\,\tilde v_0 + (1-\rho)\,r_i\|$")
    a1.set_ylabel("share of queries (all heads)")
    a1.set_title(f"$\\rho^*$ distribution ({below / max(total, 1):.1%} below −1, {above / max(total, 1):.1%} above 2)",
                 fontsize=10)
    legend_outside(a1, fontsize=8)
    by = heads.groupby("layer")
    a2.plot(by.rho_star_median_interior.mean().index, by.rho_star_median_interior.mean().values, marker="o",
            color="#1f77b4", label=r"median $\rho^*$ in (0, 1)")
    a2.plot(by.fit_vertex_interior.mean().index, by.fit_vertex_interior.mean().values, marker="s",
            color="#d62728", label="empirical fit: convex, vertex in (0, 1)")
    a2.set_ylim(-0.05, 1.05)
    a2.set_xlabel("layer")
    a2.set_ylabel("share of heads")
    a2.set_title("interior minimum per layer", fontsize=10)
    legend_outside(a2, fontsize=8)
    fig.suptitle(f"{_model_title(heads)}: where the output norm is smallest as a function of the sink rate",
                 fontsize=11)
    return save_figure(fig, path)


def fig_anti_alignment(heads: pd.DataFrame, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    rng = np.random.default_rng(0)
    for ax, col, title in ((axes[0], "cos_v0_m_median", r"$\cos(\tilde v_0, m_i)$: sink value vs semantic mean"),
                           (axes[1], "cos_v0_vj_median", r"$\cos(\tilde v_0, \tilde v_j)$, $j > 0$: sink value vs each value")):
        x = heads.layer + rng.uniform(-0.2, 0.2, len(heads))
        ax.scatter(x, heads[col], s=10, alpha=0.6, color="#1f77b4", label="head median")
        med = heads.groupby("layer")[col].median()
        ax.plot(med.index, med.values, color="#d62728", lw=2, label="layer median")
        ax.axhline(0, color="#333333", lw=0.8)
        share = (heads[col] < 0).mean()
        ax.set_title(f"{title}\n{share:.0%} of heads with negative median", fontsize=10)
        ax.set_xlabel("layer")
        legend_outside(ax, fontsize=8)
    axes[0].set_ylabel("median cosine (head space via G)")
    fig.suptitle(f"{_model_title(heads)}: anti-alignment of the sink's projected value", fontsize=11)
    return save_figure(fig, path)


def fig_decomposition(heads: pd.DataFrame, path: Path) -> Path:
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.8))
    names = [("attention", r"attention $a_{ij}$"), ("relative_norm", r"relative norm $\|\tilde v_j\|/\|o_i\|$"),
             ("cosine", r"$\cos(o_i, \tilde v_j)$")]
    for ax, (k, label) in zip(axes[:3], names):
        vals = [heads[f"sink_{k}"], heads[f"tail_{k}"]]
        med = [v.median() for v in vals]
        q = [(v.median() - v.quantile(0.25), v.quantile(0.75) - v.median()) for v in vals]
        ax.bar([0, 1], med, yerr=np.array(q).T, color=[COLORS["sink"], COLORS["tail"]], capsize=4, alpha=0.85)
        ax.set_xticks([0, 1], ["sink", "tail"])
        ax.axhline(0, color="#333333", lw=0.6)
        ax.set_title(label, fontsize=10)
        ax.set_ylabel("median over heads (IQR)")
    ax = axes[3]
    colors = ["#9467bd", "#ff7f0e", "#2ca02c"]
    for i, ((k, _), c) in enumerate(zip(names, colors)):
        v = np.array([heads[f"sink_share_{k}"].mean(), heads[f"tail_share_{k}"].mean()])
        ax.bar(np.array([0, 1]) + (i - 1) * 0.27, v, width=0.27, color=c,
               label={"attention": "attention", "relative_norm": "relative norm", "cosine": "cosine"}[k])
    ax.set_xticks([0, 1], ["sink", "tail"])
    ax.set_ylabel(r"$\mathrm{Cov}(\log f, \log|c|)/\mathrm{Var}(\log|c|)$" "\n(mean over heads; sums to 1)")
    ax.set_title("which factor explains the contribution", fontsize=10)
    ax.axhline(0, color="#333333", lw=0.6)
    ax.set_ylim(min(0.0, ax.get_ylim()[0]), max(1.0, ax.get_ylim()[1]) * 1.15)
    legend_outside(ax, fontsize=8, loc="upper center")
    fig.suptitle(f"{_model_title(heads)}: contribution $c = a \\cdot (\\|\\tilde v\\|/\\|o\\|) \\cdot \\cos$, sink vs tail", fontsize=11)
    return save_figure(fig, path)


def fig_removal(removal: pd.DataFrame, ppl: pd.DataFrame, path: Path) -> Path:
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.9), gridspec_kw={"width_ratios": [1.2, 1.2, 1.2, 0.7]})
    label = {"none": "unedited", "sink": "sink removed", "control": "control removed"}
    color = {"none": COLORS["base"], "sink": COLORS["removed"], "control": COLORS["control"]}
    for mode in ("none", "sink", "control"):
        sub = removal[removal["mode"] == mode]
        by = sub.groupby("layer")
        for ax, col in zip(axes[:3], ("output_norm", "cone", "cone_sink_heavy")):
            y = by[col].mean()
            ax.plot(y.index, y.values, marker="o", ms=3, color=color[mode], label=label[mode])
    axes[0].set_ylabel(r"mean head output norm $\|o_i^h\|$")
    axes[0].set_yscale("log")
    axes[0].set_title("output norm (all queries)", fontsize=10)
    axes[1].set_ylabel(r"cone measure $\kappa = \sum_{j>0} \tilde a_{ij} \cos(o_i, \tilde v_j)$")
    axes[1].set_title("position in the semantic cone (all queries)", fontsize=10)
    axes[2].set_ylabel(r"cone measure $\kappa$")
    axes[2].set_title("queries with sink rate ≥ 0.5", fontsize=10)
    for ax in axes[:3]:
        ax.set_xlabel("layer")
    legend_outside(axes[2], fontsize=8)                 # the same three lines in each panel: one legend
    p = ppl.set_index("pass")
    mass = removal[removal["mode"] != "none"].groupby("mode").removed_mass.mean()
    bars = [p.loc["sink", "delta_ppl"], p.loc["control", "delta_ppl"]]
    ax = axes[3]
    ax.bar([0, 1], bars, color=[COLORS["removed"], COLORS["control"]], alpha=0.85)
    ax.set_xticks([0, 1], [f"sink\n(mass {mass.get('sink', np.nan):.2f})",
                           f"control\n(mass {mass.get('control', np.nan):.2f})"])
    ax.set_ylabel("ΔPPL")
    top = max(max(bars), 0)
    bottom = min(min(bars), 0)
    span = (top - bottom) or 1.0
    ax.set_ylim(bottom - 0.05 * span, top + 0.18 * span)
    ax.axhline(0, color="#333333", lw=0.6)
    ax.set_title(f"perplexity change\n(unedited PPL {p.loc['none', 'ppl']:.2f})", fontsize=10)
    for i, b in enumerate(bars):
        ax.annotate(f"{b:+.3g}", (i, b), ha="center", va="bottom" if b >= 0 else "top", fontsize=9,
                    xytext=(0, 2 if b >= 0 else -2), textcoords="offset points")
    fig.suptitle(f"{_model_title(removal)}: sink-norm removal vs a mass-matched control source "
                 "(mass = mean attention removed per query and head)", fontsize=11)
    return save_figure(fig, path)


def fig_drift(drift: pd.DataFrame, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    layers = sorted(drift.layer.unique())
    groups = np.array_split(np.array(layers), min(4, len(layers)))
    cmap = plt.get_cmap("viridis")
    for gi, g in enumerate(groups):
        if len(g) == 0:
            continue
        sub = drift[drift.layer.isin(g) & (drift.queries > 0)]
        x = (sub.bin_lo + sub.bin_hi) / 2
        sub = sub.assign(x=x, wr=sub.sink_rate * sub.queries)
        agg = sub.groupby("x")[["wr", "queries"]].sum()
        agg["cancel"] = sub.groupby("x").cancel.median()
        lab = f"layers {g[0]}–{g[-1]}" if len(g) > 1 else f"layer {g[0]}"
        col = cmap(gi / max(1, len(groups) - 1))
        axes[0].plot(agg.index, agg.wr / agg.queries, marker="o", ms=3, color=col, label=lab)
        axes[1].plot(agg.index, agg.cancel, marker="o", ms=3, color=col, label=lab)
    axes[0].set_xlabel("normalised entropy of the non-sink attention")
    axes[0].set_ylabel(r"mean sink rate $\rho$ (all heads)")
    axes[0].set_title("diffuse queries and the sink", fontsize=10)
    axes[1].set_xlabel("normalised entropy of the non-sink attention")
    axes[1].set_ylabel("cancel (median over heads)")
    axes[1].set_title("sink's cancellation of the semantic mean $m_i$:\n"
                      r"$\sum -\langle\rho\,\tilde v_0, m_i\rangle/\|m_i\| \,/\, \sum \|m_i\|$ per head and bin", fontsize=10)
    axes[1].axhline(0, color="#333333", lw=0.6)
    legend_outside(axes[-1], fontsize=8)                # the same layers in both panels: one legend
    fig.suptitle(f"{_model_title(drift)}: semantic drift and the sink", fontsize=11)
    return save_figure(fig, path)


def render(out_dir, fmt: str = "png") -> list[Path]:
    """Draw every figure from the tables in ``out_dir`` in format ``fmt``; returns their paths."""
    out = Path(out_dir)
    heads = pd.read_parquet(out / "heads.parquet")
    curve = pd.read_parquet(out / "curve.parquet")
    drift = pd.read_parquet(out / "drift.parquet")
    hist = pd.read_parquet(out / "hist.parquet")
    removal = pd.read_parquet(out / "removal.parquet")
    ppl = pd.read_parquet(out / "ppl.parquet")
    with figure_note(run_note(out)):
        return [
            fig_convexity(heads, curve, out / f"sinks-convexity.{fmt}"),
            fig_rho_star(heads, hist, out / f"sinks-rho-star.{fmt}"),
            fig_anti_alignment(heads, out / f"sinks-anti-alignment.{fmt}"),
            fig_decomposition(heads, out / f"sinks-decomposition.{fmt}"),
            fig_removal(removal, ppl, out / f"sinks-removal.{fmt}"),
            fig_drift(drift, out / f"sinks-drift.{fmt}"),
        ]


if __name__ == "__main__":  # pragma: no cover
    for p in render(sys.argv[1]):
        print(p)
