"""Figures and the Markdown report of ``attngeom analyze``.

- :func:`draw_token_maps` — one layer, token level (all heads): attention, contribution,
  value-weighted and output-normalised maps in a 2x2 grid.
- :func:`draw_head_grid` — one layer, head by head: attention beside intra-head contribution.
- :func:`draw_sinks` — per layer: sink attention vs sink contribution, mean over heads with the
  per-head spread.
- :func:`report_markdown` — ``report.md`` from ``summary.json``'s content.

Conventions: queries on the vertical axis (row ``i``), sources on the horizontal axis (column ``j``);
pairs a query cannot see (``j > i``) are drawn in light grey. Non-negative maps use a square-root
colour scale (the sink column would otherwise wash everything else out); contributions, which can be
negative, use a diverging map centred at 0 on a signed square-root scale, clipped at the 99.5th
percentile of ``|value|`` (the colour bar's pointed ends say when it clips).
"""

from __future__ import annotations

from pathlib import Path

from attngeom.metrics import registry
from attngeom.reports import markdown as md
from attngeom.reports.common import DPI, MIN_FONT_PT, save_figure  # sets the Agg backend first

import matplotlib
import numpy as np
from matplotlib import colors

MAX_LABELLED_TOKENS = 64
MAX_GRID_LABELLED_TOKENS = 40
TICK_PITCH_IN = 1.08 * MIN_FONT_PT / 72  # one token label of MIN_FONT_PT points per row: the map grows with T
MAP_DPI = DPI            # token-level maps with token labels (small fonts need the resolution)
MAP_DPI_UNLABELLED = 100 # token-level maps of long inputs: >= 2 pixels per token up to ~200 tokens
GRID_DPI = 110           # per-head grids, 2-inch maps
DIVIDER_COLOR = "#2da44e"
MASK_COLOR = "#e6e6e6"
SEQ_CMAP = "magma_r"
DIV_CMAP = "RdBu_r"

TOKEN_LEVEL = tuple((name, registry.label(name).capitalize(), registry.get(name).token_latex)
                    for name in ("attention", "contribution", "value_weighted", "output_normalized"))
"""The token-level maps drawn, in the order of the 2x2 grid: (metric, title and formula from the
registry)."""


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def token_label(tok: str, max_len: int = 12) -> str:
    """A token string readable as a tick label: a line break shown as '↵', a tab '→', a carriage
    return '⏎' (glyphs DejaVu Sans has), a leading space as '␣'."""
    s = tok.replace("\n", "↵").replace("\t", "→").replace("\r", "⏎")
    if s.startswith(" "):
        s = "␣" + s[1:]
    s = s.replace("$", r"\$")
    return s if len(s) <= max_len else s[: max_len - 1] + "…"


def _causal_mask(T: int) -> np.ndarray:
    return np.triu(np.ones((T, T), dtype=bool), k=1)


def _robust_abs_max(x: np.ndarray, q: float = 99.5) -> tuple[float, bool]:
    """Symmetric colour limit for a diverging map and whether it clips some values."""
    vals = np.abs(x[np.isfinite(x)])
    if vals.size == 0:
        return 1.0, False
    lim = float(np.percentile(vals, q))
    full = float(vals.max())
    if lim <= 0:
        lim = full if full > 0 else 1.0
    return lim, full > lim * 1.0001


def _signed_sqrt(x):
    return np.sign(x) * np.sqrt(np.abs(x))


def _signed_square(y):
    return np.sign(y) * y * y


def _div_norm(lim: float) -> colors.Normalize:
    """Diverging norm centred at 0 on a signed square-root scale (small contributions stay visible)."""
    return colors.FuncNorm((_signed_sqrt, _signed_square), vmin=-lim, vmax=lim)


def _seq_norm(x: np.ndarray) -> colors.Normalize:
    vals = x[np.isfinite(x)]
    vmax = float(vals.max()) if vals.size and vals.max() > 0 else 1.0
    return colors.PowerNorm(gamma=0.5, vmin=0.0, vmax=vmax)


def _cmap(name: str):
    return matplotlib.colormaps[name].with_extremes(bad=MASK_COLOR)


def draw_map(ax, m: np.ndarray, *, diverging: bool, tokens: list[str] | None, fig, title: str,
              colorbar: bool = True, norm=None, ticks: bool = True, cax=None, divider: int | None = None,
              offset: int = 0, fontsize: float = 9):
    """One map with its title (``fontsize``; labels and ticks a little smaller, never below
    :data:`MIN_FONT_PT`); ``divider``: a line before that row and column (the first answer token);
    ``offset``: the position of the first row and column (a cropped map)."""
    T = m.shape[0]
    small = max(MIN_FONT_PT, fontsize - 2)
    shown = np.where(_causal_mask(T), np.nan, m)
    extend = "neither"
    if norm is None:
        if diverging:
            lim, clips = _robust_abs_max(shown)
            norm = _div_norm(lim)
            extend = "both" if clips else "neither"
        else:
            norm = _seq_norm(shown)
    im = ax.imshow(shown, cmap=_cmap(DIV_CMAP if diverging else SEQ_CMAP), norm=norm,
                   interpolation=_interpolation(T, ax.get_position().width * fig.get_figwidth() * fig.dpi),
                   aspect="equal")
    # a plain text above the axes: set_title re-measures the tick labels to place itself
    ax.text(0.5, 1.015, title, transform=ax.transAxes, fontsize=fontsize + 1, ha="center", va="bottom")
    if divider is not None and 0 < divider - offset < T:
        d = divider - offset - 0.5
        ax.axhline(d, color=DIVIDER_COLOR, lw=1.0)
        ax.axvline(d, color=DIVIDER_COLOR, lw=1.0)
    # a small margin left of column 0, so that the sink column is not hidden under the frame
    if T > MAX_LABELLED_TOKENS:
        ax.set_xlim(-0.5 - 0.012 * T, T - 0.5)
    for spine in ax.spines.values():
        spine.set_linewidth(0.6)
    if ticks and tokens is not None and T <= MAX_LABELLED_TOKENS:
        labels = [token_label(t) for t in tokens]
        ax.set_xticks(range(T))
        ax.set_xticklabels(labels, rotation=90, fontsize=MIN_FONT_PT)
        ax.set_yticks(range(T))
        ax.set_yticklabels(labels, fontsize=MIN_FONT_PT)
        ax.tick_params(length=1.5, pad=1)
        ax.set_xlabel("source token $j$", fontsize=small)
        ax.set_ylabel("query token $i$", fontsize=small)
    elif ticks:
        if offset:
            from matplotlib.ticker import FuncFormatter

            shift = FuncFormatter(lambda x, _: f"{int(round(x)) + offset}")
            ax.xaxis.set_major_formatter(shift)
            ax.yaxis.set_major_formatter(shift)
        ax.set_xlabel("source position $j$", fontsize=small)
        ax.set_ylabel("query position $i$", fontsize=small)
        ax.tick_params(labelsize=MIN_FONT_PT)
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    if colorbar:
        cb = fig.colorbar(im, cax=cax, extend=extend) if cax is not None else \
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, extend=extend)
        cb.ax.tick_params(labelsize=MIN_FONT_PT)
    return im


def _figure(width: float, height: float, dpi: float):
    """A figure on the Agg canvas, made at the resolution it is saved at (so text is laid out once)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> None:
    """At the figure's own resolution, in the format of ``path``; laid out by hand already."""
    save_figure(fig, path, dpi=fig.dpi, layout=False)


def _interpolation(T: int, pixels: float) -> str:
    """Each token a sharp cell when the map is drawn larger than ``T`` pixels; smoothed (antialiased)
    when smaller, so that one-token features such as the sink column are not dropped."""
    return "nearest" if pixels >= T else "antialiased"


def wrapped(text: str, width_in: float, fontsize: float) -> str:
    """``text`` broken at spaces into lines that fit ``width_in`` inches (existing breaks kept)."""
    import textwrap

    chars = max(20, int(width_in * 72 / (0.55 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def _axes_at(fig, x: float, y: float, w: float, h: float):
    """Axes at a fixed place given in inches from the bottom left. The analyze figures are laid out
    by hand: constrained/tight layout measured every tick label of every panel again and took most
    of the drawing time."""
    W, H = fig.get_size_inches()
    return fig.add_axes((x / W, y / H, w / W, h / H))


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------


def draw_token_maps(layer_trace, tokens: list[str], path: str | Path, title: str = "",
                    divider: int | None = None) -> str:
    """``maps_layer{L}.png``: the token-level maps (all heads) of one layer in a 2x2 grid:
    attention and contribution on top, value-weighted and output-normalised below. ``divider``:
    the first answer token's position (a line between prompt and answer)."""
    path = Path(path)
    T = len(tokens)
    labelled = T <= MAX_LABELLED_TOKENS
    # inches: room for tick labels left of / below each map, the map (a token label per row), its
    # colour bar, its title
    left, bottom, box = (1.05, 1.0, max(4.6, T * TICK_PITCH_IN)) if labelled else (0.7, 0.6, 4.2)
    right, title_h, top = 0.85, 0.45, 0.8
    panel_w, panel_h = left + box + right, bottom + box + title_h
    fig = _figure(2 * panel_w, 2 * panel_h + top, MAP_DPI if labelled else MAP_DPI_UNLABELLED)
    for k, (name, label, formula) in enumerate(TOKEN_LEVEL):
        x0, y0 = (k % 2) * panel_w + left, (1 - k // 2) * panel_h + bottom
        ax, cax = _axes_at(fig, x0, y0, box, box), _axes_at(fig, x0 + box + 0.12, y0, 0.17, box)
        m = layer_trace.token_score(name)
        draw_map(ax, m, diverging=name == "contribution", tokens=tokens, fig=fig, title=f"{label}: {formula}",
                  cax=cax, divider=divider)
    answer = "; green line: prompt | answer" if divider is not None and 0 < divider < T else ""
    fig.suptitle(f"{title} — layer {layer_trace.index}, all {layer_trace.num_heads} heads, T = {T} tokens\n"
                 "rows: queries $i$; columns: sources $j$; grey: not visible (causal mask); "
                 f"colour scales: square root (signed for the contribution){answer}", fontsize=11,
                 y=1 - 0.12 / fig.get_figheight(), va="top")
    _save(fig, path)
    return path.name


def draw_head_grid(layer_trace, tokens: list[str], path: str | Path, heads: list[int] | None = None,
                   title: str = "", divider: int | None = None) -> str:
    """``heads_layer{L}.png``: for each head, attention ``a_ij^h`` beside the intra-head contribution
    ``c_ij^h``, with shared colour scales across heads; token labels left of the first column and
    below the last row (up to :data:`MAX_GRID_LABELLED_TOKENS` tokens); ``divider``: the first
    answer token's position (a line between prompt and answer on every map).

    All maps are images placed in one canvas axes measured in inches (an axes per map, each with
    its own ticks and layout, cost most of the drawing time)."""
    from matplotlib.patches import Rectangle

    path = Path(path)
    heads = list(range(layer_trace.num_heads)) if heads is None else list(heads)
    att = layer_trace.attention[heads]
    con = layer_trace.contribution[heads]
    T = att.shape[-1]
    n = len(heads)
    per_row = 3 if n > 4 else min(n, 2) if n > 1 else 1
    rows = int(np.ceil(n / per_row))
    # inches: square maps of side ``box`` in pairs, a title above each, two colour bars on the right
    labelled = T <= MAX_GRID_LABELLED_TOKENS
    box, pair_gap, group_gap, title_h, left, bottom, top, right = 2.0, 0.1, 0.3, 0.3, 0.15, 0.15, 0.8, 2.35
    labels = [token_label(t) for t in tokens] if labelled else []
    if labelled:
        box = max(box, T * TICK_PITCH_IN)
        margin = 0.1 + 0.6 * MIN_FONT_PT / 72 * max(len(x) for x in labels)
        left, bottom = left + margin, bottom + margin
    grid_w = per_row * (2 * box + pair_gap) + (per_row - 1) * group_gap
    grid_h = rows * (box + title_h) - title_h
    fig = _figure(left + grid_w + right, bottom + grid_h + title_h + top, GRID_DPI)
    canvas = _axes_at(fig, left, bottom, grid_w, grid_h + title_h)
    canvas.set_xlim(0, grid_w)
    canvas.set_ylim(0, grid_h + title_h)
    canvas.set_axis_off()
    mask = _causal_mask(T)
    att_norm = _seq_norm(np.where(mask, np.nan, att))
    lim, clips = _robust_abs_max(np.where(mask[None], np.nan, con))
    con_norm = _div_norm(lim)
    att_cmap, con_cmap = _cmap(SEQ_CMAP), _cmap(DIV_CMAP)
    pad = 0.03  # the frame sits just outside the map, so that the sink column is not hidden under it
    im_a = im_c = None
    for k, h in enumerate(heads):
        r, c = divmod(k, per_row)
        x, y = c * (2 * box + pair_gap + group_gap), (rows - 1 - r) * (box + title_h)
        sink_a = float(att[k][1:, 0].mean()) if T > 1 else float("nan")
        sink_c = float(con[k][1:, 0].mean()) if T > 1 else float("nan")
        for x0, m, cmap, norm, label in ((x, att[k], att_cmap, att_norm, f"head {h}: attention (sink {sink_a:.2f})"),
                                         (x + box + pair_gap, con[k], con_cmap, con_norm,
                                          f"head {h}: contribution (sink {sink_c:.2f})")):
            im = canvas.imshow(np.where(mask, np.nan, m), cmap=cmap, norm=norm,
                               interpolation=_interpolation(T, box * fig.dpi),
                               extent=(x0, x0 + box, y, y + box), aspect="auto")
            canvas.add_patch(Rectangle((x0 - pad, y - pad), box + 2 * pad, box + 2 * pad, fill=False, lw=0.6,
                                       clip_on=False))
            canvas.text(x0 + box / 2, y + box + 0.06, label, fontsize=8, ha="center", va="bottom")
            if divider is not None and 0 < divider < T:
                d = divider * box / T
                canvas.plot([x0, x0 + box], [y + box - d] * 2, color=DIVIDER_COLOR, lw=0.8)
                canvas.plot([x0 + d] * 2, [y, y + box], color=DIVIDER_COLOR, lw=0.8)
            _grid_labels(canvas, labels, x0, y, box, left_side=c == 0 and x0 == x, below=r == rows - 1)
            if cmap is att_cmap:
                im_a = im
            else:
                im_c = im
    canvas.set_xlim(0, grid_w)          # imshow moved the limits; the canvas is measured in inches
    canvas.set_ylim(0, grid_h + title_h)
    x_cb = left + grid_w + 0.2
    cb = fig.colorbar(im_a, cax=_axes_at(fig, x_cb, bottom, 0.14, grid_h))
    cb.set_label("attention $a_{ij}^h$\n(square-root scale)", fontsize=8)
    cb.ax.tick_params(labelsize=7)
    cb2 = fig.colorbar(im_c, cax=_axes_at(fig, x_cb + 0.95, bottom, 0.14, grid_h),
                       extend="both" if clips else "neither")
    cb2.set_label("contribution $c_{ij}^h$ (intra-head;\nsigned square-root scale)", fontsize=8)
    cb2.ax.tick_params(labelsize=7)
    fig.suptitle(wrapped(f"{title} — layer {layer_trace.index}, per head: attention beside contribution\n"
                          f"(T = {T}; rows $i$ = queries, columns $j$ = sources; "
                          r"sink = mean over queries $i>0$ of the sink column $j=0$)", fig.get_figwidth(), 10),
                 fontsize=10, y=1 - 0.1 / fig.get_figheight(), va="top")
    _save(fig, path)
    return path.name


def _grid_labels(canvas, labels: list[str], x0: float, y: float, box: float, left_side: bool, below: bool) -> None:
    """Token labels of one map of a per-head grid (canvas in inches): rows left of it, columns below."""
    T = len(labels)
    for i, lab in enumerate(labels):
        c = (i + 0.5) * box / T
        if left_side:
            canvas.text(x0 - 0.06, y + box - c, lab, fontsize=MIN_FONT_PT, ha="right", va="center")
        if below:
            canvas.text(x0 + c, y - 0.06, lab, fontsize=MIN_FONT_PT, ha="center", va="top", rotation=90)


def draw_sinks(heads_df, path: str | Path, title: str = "") -> str:
    """``sinks_per_layer.png``: per layer, how much attention the sink gets and how much of the
    output it explains. Left: per head (mean over heads, line; each head, dots; min-max, band).
    Right: token level — mean sink attention vs the sink's share of the layer output Σ_h C_i0^h."""
    path = Path(path)
    layers = sorted(heads_df["layer"].unique())
    g = heads_df.groupby("layer")
    x = np.array(layers)
    fig = _figure(12, 4.4, DPI)
    ax1, ax2 = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.12, top=0.86, wspace=0.18)
    series = (("sink_rate", "C0", r"sink attention $a_{i0}^h$"),
              ("sink_contribution", "C3", r"sink contribution $c_{i0}^h$ (intra-head)"))
    rng = np.random.default_rng(0)
    for col, c, label in series:
        mean = g[col].mean().reindex(layers).to_numpy()
        lo = g[col].min().reindex(layers).to_numpy()
        hi = g[col].max().reindex(layers).to_numpy()
        ax1.fill_between(x, lo, hi, color=c, alpha=0.12, linewidth=0)
        jitter = rng.uniform(-0.15, 0.15, len(heads_df)) if len(layers) > 1 else 0
        ax1.scatter(heads_df["layer"].to_numpy() + jitter, heads_df[col].to_numpy(), s=7, color=c, alpha=0.45,
                    linewidths=0)
        ax1.plot(x, mean, "-o", color=c, ms=3.5, lw=1.6, label=f"{label}: mean over heads")
    ax1.axhline(0, color="0.3", lw=0.7)
    ax1.set_xlabel("layer")
    ax1.set_ylabel("mean over queries $i>0$")
    ax1.set_title("Per head: dots = heads, band = min–max over heads", fontsize=10)
    ax1.legend(fontsize=8, loc="best", frameon=True, framealpha=0.85)

    share = g["sink_contribution_inter"].sum().reindex(layers).to_numpy()
    att = g["sink_rate"].mean().reindex(layers).to_numpy()
    ax2.plot(x, att, "-o", color="C0", ms=3.5, lw=1.6, label=r"sink attention (mean over heads)")
    ax2.plot(x, share, "-s", color="C3", ms=3.5, lw=1.6,
             label=r"sink's share of the layer output $\Sigma_h C_{i0}^h$")
    ax2.axhline(0, color="0.3", lw=0.7)
    ax2.set_xlabel("layer")
    ax2.set_ylabel("mean over queries $i>0$")
    ax2.set_title("Layer level", fontsize=10)
    ax2.legend(fontsize=8, loc="best", frameon=True, framealpha=0.85)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.25, lw=0.5)
        if len(layers) <= 40:
            step = 1 if len(layers) <= 16 else 2 if len(layers) <= 32 else 4
            ax.set_xticks(x[::step])
    n_q = int(heads_df["queries"].iloc[0]) if len(heads_df) else 0
    fig.suptitle(f"{title} — attention to the sink (position 0) vs its contribution, per layer "
                 f"({n_q} queries)", fontsize=11)
    _save(fig, path)
    return path.name


# --------------------------------------------------------------------------------------------
# report.md
# --------------------------------------------------------------------------------------------

FILE_NOTES = {
    "tokens.parquet": "per (text/window, layer, position): token, scores received (attention, value-weighted, "
                      "output-normalised, contribution; mean over the queries that see it), value norm, "
                      "sink rate, entropy, output norm",
    "heads.parquet": "per (layer, head): sink rate, sink contribution (intra and inter), self-attention, "
                     "entropy, head output norm, head share, source-winner shares",
    "summary.json": "model, input, per-layer sink numbers, top tokens, runtime, files",
    "sinks_per_layer.png": "per layer: sink attention vs sink contribution",
    "report.md": "this file",
    "answer_shares.parquet": "per generated token and layer (and the model): contribution and attention from "
                             "the sink, the prompt and the earlier answer (docs/generation.md)",
    "answer_sources.parquet": "per generated token, layer (and the model) and metric: its top sources (prompt and "
                              "earlier answer; special and template tokens marked)",
    "answer_heads.parquet": "per generated token (and the whole answer) and measure: the (layer, head, source) "
                            "triples with the largest shares of their layer's output (docs/generation.md)",
    "answer_summary.parquet": "per layer (and the model) and prompt token: mean attention and contribution over "
                              "the answer (which prompt tokens it drew on)",
}


def report_markdown(summary: dict) -> str:
    """``report.md``. Every string that comes from the user, the model or the tokenizer (model name
    and spec, input file name, tokens, file names) and every table cell is escaped by
    :mod:`attngeom.reports.markdown`."""
    m, inp = summary["model"], summary["input"]
    t = md.text
    lines = [f"# attngeom analyze — {t(m['name'])}", ""]
    lines.append(f"- model: {t(m['name'])} ({t(m['spec'])}, {t(m['architecture'])}, {m['layers']} layers, "
                 f"{m['heads']} heads, {m['kv_heads']} KV heads, {t(m['dtype'])} on {t(m['device'])})")
    win = (f", in {inp['windows']} windows of {inp['window']} tokens (stride {inp['stride'] or inp['window'] - 1})"
           if inp["windows"] > 1 or inp["window"] else "")
    lines.append(f"- input: {t(inp['source'])} — {inp['tokens']} tokens{win}")
    lines.append(f"- layers analysed: {md.ranges(summary['layers'])}; maps: {t(summary['maps'])}")
    lines.append(f"- attngeom {t(summary['attngeom_version'])}, {summary['runtime_s']['total']:.1f} s in all")
    lines += ["", "## Headline numbers", ""]
    lines.append(f"Mean over layers and heads: sink attention **{summary['mean_sink_attention']:.3f}**, "
                 f"sink contribution (intra-head) **{summary['mean_sink_contribution']:.3f}**.")
    lines.append("")
    lines += md.table(["layer", "sink attention", "sink contribution (intra)", "sink share of layer output"],
                      ([r["layer"], f"{r['sink_attention']:.3f}", f"{r['sink_contribution']:.3f}",
                        f"{r['sink_contribution_to_layer_output']:.3f}"] for r in summary["per_layer"]),
                      align="rrrr")
    top = summary["top_tokens"]
    lines += ["", f"Top {len(top['by_contribution_received'])} tokens at layer {top['layer']} "
                  f"({t(top['ranked_over'])}):", ""]

    def tok(c: dict) -> md.Raw:
        return md.Raw(f"{md.token(c['token'])} @{c['position']}")

    lines += md.table(["rank", "by contribution received", "score", "by attention received", "score"],
                      ([k, tok(c), f"{c['score']:.4f}", tok(a), f"{a['score']:.4f}"]
                       for k, (c, a) in enumerate(zip(top["by_contribution_received"],
                                                      top["by_attention_received"]), 1)),
                      align="rlrlr")
    if "generation" in summary:
        lines += _generation_lines(summary["generation"])
        lines += _answer_heads_lines(summary["generation"].get("heads_behind_the_answer", []))
    lines += ["", "## Files", ""]
    for f in summary["files"]:
        if f.startswith("maps_layer"):
            note = "token-level maps (all heads): attention, contribution, value-weighted, output-normalised"
        elif f.startswith("heads_layer"):
            note = "per head: attention beside intra-head contribution"
        else:
            note = FILE_NOTES.get(f, FILE_NOTES.get(f.rsplit(".", 1)[0] + ".png", ""))
        lines.append(f"- {md.link(f, f)} — {md.text(note)}")
    return "\n".join(lines) + "\n"


def _generation_lines(gen: dict) -> list[str]:
    """The model's answer (``analyze --generate``): its text, where its contribution came from (mean
    over its tokens and the layers) and the prompt tokens it drew on most."""
    sh = gen["mean_contribution_share"]
    lines = ["", "## The model's answer", "",
             f"{gen['prompt_tokens']} prompt tokens, {gen['answer_tokens']} generated"
             + (" (ended on a stop token)" if gen["stopped_on_stop_token"] else "") + ":", "",
             "```text", gen["answer_text"].replace("```", "ˋˋˋ"), "```", "",
             *(["The model's tokenizer has no chat template: the prompt used attngeom's plain fallback template "
                "('User: ...', then 'Assistant:'; docs/generation.md).", ""]
               if gen.get("chat_template") == "fallback" else []),
             f"Contribution of each answer token's predicting row, mean over tokens and layers: sink "
             f"**{sh['sink']:.3f}**, prompt **{sh['prompt']:.3f}**, earlier answer **{sh['answer']:.3f}**.", "",
             "Prompt tokens the whole answer drew on (mean over its tokens and the layers, sink, special and template tokens left out unless --rank-special):", ""]
    lines += md.table(["rank", "token", "contribution", "attention"],
                      ([k, md.Raw(f"{md.token(r['token'])} @{r['position']}"), f"{r['contribution']:.4f}",
                        f"{r['attention']:.4f}"] for k, r in enumerate(gen["prompt_tokens_the_answer_drew_on"], 1)),
                      align="rlrr")
    return lines


def _answer_heads_lines(rows: list[dict]) -> list[str]:
    """The heads behind the whole answer (summary.json's ``generation.heads_behind_the_answer``)."""
    if not rows:
        return []
    lines = ["", "Heads behind the whole answer: (layer, head, source) shares of the layer's attention output "
             "C_ij^h, mean over the answer's predicting rows (answer_heads.parquet; each layer's shares sum to 1; "
             "special and template tokens left out unless --rank-special). A share is not a cause: the direct "
             "effect is the head's output straight onto the answer tokens' logits (mean over the answer; "
             "attngeom.head_effects adds ablation):", ""]
    lines += md.table(["rank", "layer", "head", "source", "part", "share", "rank in layer", "direct effect"],
                      ([k, r["layer"], r["head"], md.Raw(f"{md.token(r['token'])} @{r['source']}"), r["part"],
                        f"{r['share']:.4f}", r["rank_in_layer"],
                        "" if r.get("direct_effect") is None or r["direct_effect"] != r["direct_effect"]
                        else f"{r['direct_effect']:+.3f}"] for k, r in enumerate(rows, 1)),
                      align="rrrllrrr")
    return lines


