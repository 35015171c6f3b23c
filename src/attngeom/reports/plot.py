"""The plotting API: figures for a paper from a :class:`~attngeom.traces.trace.Trace` or from a run's
tables, in any format matplotlib writes (the file name's suffix: ``.pdf``, ``.svg``, ``.png``, ...).

- :func:`token_map` (also ``trace.plot_token_map(...)``) — one map of one layer, token level or one
  head, any metric of :mod:`attngeom.metrics.registry`, cropped to a token range, one column wide
  by default (:data:`~attngeom.reports.common.COLUMN_WIDTH_IN` inches), token labels of
  :data:`~attngeom.reports.common.MIN_FONT_PT` points (every k-th when they would not fit), a title,
  axis labels (query token, source token), a colour bar naming the metric and its scale
  (:func:`scale_label`) and a line between prompt and answer.
- :func:`head_effects` — shares beside causes: for the top heads of a
  :func:`attngeom.traces.effects.head_effects` table, each head's share, direct and total effect,
  and (with a :func:`attngeom.traces.compare.patch_heads` table) the share of the gap patching it moves.
- :func:`run_figures` — the figures of a finished run (``attngeom sinks``, ``selection``, ``heads``,
  ``kvcache``), drawn again from its tables, in another format.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from attngeom.reports.common import COLUMN_WIDTH_IN, MIN_FONT_PT, check_format, legible, save_figure  # sets the Agg backend

import numpy as np

from attngeom.errors import InputError, OutputError
from attngeom.model.arguments import whole_number
from attngeom.runs.storage import replace_atomically

MAX_WIDTH_IN = 40.0
"""The widest :func:`token_map` drawn (inches; a poster's). The narrowest is what its labels, a one-inch
map and the colour bar need (under 3 inches)."""

RUN_FIGURES = ("sinks", "selection", "heads", "kvcache", "kvtasks", "faithfulness")
"""The commands whose figures :func:`run_figures` draws again from their tables."""


AXIS_LABEL_IN = 0.15
"""Room for an axis label at :data:`~attngeom.reports.common.MIN_FONT_PT` points, in inches (left and below the map)."""


def scale_label(diverging: bool) -> str:
    """The colour scale of a map, as its colour bar says it: a signed square root clipped at the
    99.5th percentile of the absolute values for signed maps (contributions), a square root from 0 to
    the maximum for the others (``attngeom.reports.analyze.draw_map``)."""
    return ("signed $\\sqrt{\\cdot}$, clipped at 99.5th pct of $|x|$" if diverging
            else "$\\sqrt{\\cdot}$ scale, 0 to max")


def _span(tokens, T: int) -> tuple[int, int]:
    """``tokens`` (None, a ``slice`` or ``(start, stop)``) as ``0 <= start < stop <= T``."""
    if tokens is None:
        return 0, T
    if isinstance(tokens, slice):
        if tokens.step not in (None, 1):
            raise InputError("tokens: a slice with a step is not a token range")
        start, stop, _ = slice(*(None if x is None else whole_number(x, "tokens") for x in
                                 (tokens.start, tokens.stop))).indices(T)
    else:
        pair = tuple(tokens) if isinstance(tokens, (tuple, list)) else ()
        if len(pair) != 2:
            raise InputError(f"tokens must be a slice or (start, stop) of positions, not {tokens!r}"[:200])
        start, stop = (whole_number(x, "tokens") for x in pair)
        start, stop = max(0, start), min(T, stop)
    if not 0 <= start < stop <= T:
        raise InputError(f"tokens {tokens!r} select no token of the {T}")
    return start, stop


def _check_path(path) -> Path:
    """The file a figure is written to, checked before anything is drawn: a known format, not a
    directory, in an existing folder; else one-line :class:`InputError` or :class:`OutputError`."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"path must be a file name, not a value of type {type(path).__name__}")
    path = Path(path)
    check_format(path.suffix or ".png")
    if path.is_dir():
        raise OutputError(f"cannot write the figure to {path}: it is a directory")
    if not path.parent.is_dir():
        raise OutputError(f"cannot write the figure to {path}: the folder {path.parent} does not exist")
    return path


def _write(fig, path: Path) -> Path:
    """Save ``fig`` to ``path`` through a temporary file beside it: a failed write leaves no file,
    and no half-written one under ``path``'s name (:class:`OutputError`)."""
    return replace_atomically(path, lambda tmp: save_figure(fig, tmp, layout=False), f"the figure to {path}")


def token_map(trace, layer: int, metric: str = "contribution", head: int | None = None, tokens=None,
              path: str | Path | None = None, width: float = COLUMN_WIDTH_IN, title: str | None = None):
    """One map of ``trace`` at attention layer ``layer`` (its index in the model): the token-level
    ``metric`` over all heads (``head=None``) or head ``head``'s map; rows are queries, columns
    sources, grey what a query cannot see. ``tokens``: a ``slice`` or ``(start, stop)`` of positions
    (rows and columns both). ``width`` inches (height follows). Saved to ``path`` (format from its
    suffix) and the path returned; without ``path`` the matplotlib ``Figure`` is returned."""
    from matplotlib.figure import Figure

    from attngeom.metrics import registry
    from attngeom.reports.analyze import draw_map, wrapped, token_label

    layer = whole_number(layer, "layer")
    lt = next((x for x in trace.layers if x is not None and x.index == layer), None)
    if lt is None:
        have = [x.index for x in trace.layers if x is not None]
        raise InputError(f"layer {layer} is not in this trace (layers {have})")
    if head is not None and not 0 <= whole_number(head, "head") < lt.num_heads:
        raise InputError(f"head {head} does not exist (the layer has {lt.num_heads} heads)")
    if not isinstance(width, (int, float, np.number)) or isinstance(width, bool) or not math.isfinite(width):
        raise InputError(f"width must be a number of inches, not {width!r}"[:200])
    path = None if path is None else _check_path(path)
    start, stop = _span(tokens, len(trace.tokens))
    T = stop - start
    # inches: the map is square; room for token labels left and below, the colour bar right, the title above
    labels = [token_label(t) for t in trace.tokens[start:stop]]
    margin = 0.15 + 0.6 * MIN_FONT_PT / 72 * max(len(x) for x in labels) + AXIS_LABEL_IN
    narrowest = margin + 1.0 + 0.85
    if not narrowest <= width <= MAX_WIDTH_IN:
        raise InputError(f"width must be from {narrowest:.2f} inches (this map's labels, a one-inch map and its "
                         f"colour bar) to {MAX_WIDTH_IN:g}, not {width:g}")
    m = lt.token_score(metric) if head is None else lt.metric(metric)[head]
    m = m[start:stop, start:stop]
    box = width - margin - 0.85
    what = registry.label(metric) + (" (all heads)" if head is None else f", head {head}")
    title_size = MIN_FONT_PT + 1.5
    title = wrapped(title if title is not None else f"{trace.model_name or 'model'}, layer {layer}: {what}",
                     width - 0.2, title_size)
    fig = Figure(figsize=(width, box + margin + 0.15 + 0.2 * (title.count("\n") + 1)))
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    W, H = fig.get_size_inches()
    ax = fig.add_axes((margin / W, margin / H, box / W, box / H))
    cax = fig.add_axes(((margin + box + 0.08) / W, margin / H, 0.1 / W, box / H))
    diverging = bool(np.nanmin(m) < 0)      # signed maps (contributions) on a diverging scale centred at 0
    draw_map(ax, m, diverging=diverging, tokens=None, fig=fig, title="", cax=cax, ticks=False,
              divider=trace.prompt_length, offset=start, fontsize=MIN_FONT_PT + 1)
    cax.set_ylabel(f"{registry.label(metric)}\n{scale_label(diverging)}", fontsize=MIN_FONT_PT)
    step = max(1, int(np.ceil(T * 1.08 * MIN_FONT_PT / 72 / box)))
    pos = list(range(0, T, step))
    ax.set_xticks(pos)
    ax.set_xticklabels([labels[i] for i in pos], rotation=90, fontsize=MIN_FONT_PT)
    ax.set_yticks(pos)
    ax.set_yticklabels([labels[i] for i in pos], fontsize=MIN_FONT_PT)
    ax.tick_params(length=1.5, pad=1)
    ax.set_xlabel("source token $j$", fontsize=MIN_FONT_PT, labelpad=1)
    ax.set_ylabel("query token $i$", fontsize=MIN_FONT_PT, labelpad=1)
    fig.suptitle(title, fontsize=title_size, y=1 - 0.05 / H, va="top")
    legible(fig)
    if path is None:
        return fig
    return _write(fig, path)


EFFECT_COLOURS = {"share": "#7f7f7f", "direct": "#1f77b4", "total": "#d62728", "changed": "#9467bd",
                  "prediction": "#2ca02c", "all": "#8c564b"}
"""One colour per quantity of :func:`head_effects` (grey the share, the causal measures in colour)."""


def _head_rows(effects, heads, top) -> list[tuple[int, int]]:
    """The (layer, head) pairs :func:`head_effects` draws: ``heads`` as given, else the first ``top`` rows."""
    have = {(int(l), int(h)) for l, h in zip(effects["layer"], effects["head"])}
    if heads is None:
        top = whole_number(top, "top")
        if top < 1:
            raise InputError(f"top must be at least 1, not {top}")
        return [(int(l), int(h)) for l, h in zip(effects["layer"], effects["head"])][:top]
    try:
        pairs = [(whole_number(l, "layer"), whole_number(h, "head")) for l, h in heads]
    except (TypeError, ValueError):
        raise InputError(f"heads must be (layer, head) pairs, not {heads!r}"[:200]) from None
    missing = [p for p in pairs if p not in have]
    if missing or not pairs:
        raise InputError(f"heads {missing or pairs} are not rows of the effects table"[:200])
    return list(dict.fromkeys(pairs))


def head_effects(effects, patching=None, *, heads=None, top: int = 8, path: str | Path | None = None,
                 width: float = 2 * COLUMN_WIDTH_IN + 0.3, model: str | None = None, text: str | None = None,
                 text_b: str | None = None, title: str | None = None):
    """Shares beside causes, one row per head (docs/generation.md, "A share is not a cause"): for the
    heads of ``effects`` (a :func:`attngeom.traces.effects.head_effects` table; ``heads``: ``(layer,
    head)`` pairs, default its first ``top`` rows, its ranking), the head's share ``Σ_j C_ij^h`` (left), its direct
    and total effect on the table's metric (middle: logit units for a logit difference, nats for
    ``log P``), and with ``patching`` (a :func:`attngeom.traces.compare.patch_heads` table) the share of
    the gap ``m_b − m_a`` each head moves when patched from ``text_b``'s run, at each place it was
    patched (right). ``model``, ``text`` and ``text_b`` name the run in the title and foot line.
    ``width`` inches (default two columns). Saved to ``path`` (format from its suffix) and the path
    returned; without ``path`` the matplotlib ``Figure`` is returned."""
    import pandas as pd
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from attngeom.reports.analyze import token_label, wrapped

    need = {"layer", "head", "share", "direct_effect", "total_effect"}
    if not isinstance(effects, pd.DataFrame) or not need <= set(effects.columns) or effects.empty:
        raise InputError("effects must be a table of attngeom.head_effects (columns layer, head, share, "
                         "direct_effect, total_effect)")
    if patching is not None and (not isinstance(patching, pd.DataFrame)
                                 or not {"at", "layer", "head", "share_of_gap"} <= set(patching.columns)):
        raise InputError("patching must be a table of attngeom.traces.compare.patch_heads "
                         "(columns at, layer, head, share_of_gap)")
    if not isinstance(width, (int, float, np.number)) or isinstance(width, bool) or not 3.0 <= width <= MAX_WIDTH_IN:
        raise InputError(f"width must be a number of inches from 3 to {MAX_WIDTH_IN:g}, not {width!r}"[:200])
    path = None if path is None else _check_path(path)
    pairs = _head_rows(effects, heads, top)
    rows = effects.set_index(["layer", "head"]).loc[pairs]
    a = effects.attrs
    target = token_label(str(a.get("target_token", "target")), 20)
    contrast = a.get("contrast_token")
    if a.get("metric", "logit_diff" if contrast is not None else "log_prob") == "logit_diff":
        metric, unit = f"z({target}) − z({token_label(str(contrast), 20)})", "logit units"
    else:
        metric, unit = f"log P({target})", "nats"
    places = [] if patching is None else list(dict.fromkeys(patching["at"]))
    n = len(pairs)
    fs = MIN_FONT_PT
    label_in = 0.7
    panels = 3 if places else 2
    title_text = title if title is not None else (
        f"{model or 'model'}: what each head does to {metric}"
        + (f" after “{text}”" if text else "")
        + (f", against “{text_b}”" if text_b and places else ""))
    title_text = wrapped(title_text, width - 0.2, fs + 1.5)
    title_in = 0.08 + 0.2 * (title_text.count("\n") + 1)
    foot = [(f"total effect: m(clean) − m(head ablated), {a.get('ablation', 'zero')} ablation in every position; "
             "direct effect: the head's output straight to the unembedding, norms linearised at the run's scale")]
    if "clean" in a:
        foot.append(f"m = {metric} = {a['clean']:+.2f} on the clean run"
                    + (f"; patched from b: $m_a$ = {patching.attrs['m_a']:+.2f}, $m_b$ = {patching.attrs['m_b']:+.2f}"
                       if places and "m_a" in patching.attrs else ""))
    foot_text = wrapped("\n".join(foot), width - 0.2, fs)
    foot_in = 0.06 + 0.14 * (foot_text.count("\n") + 1)
    axis_in = 0.85                                     # tick labels, the two-line axis label, the legend below
    box_h = max(0.9, n * 0.2)
    gap = 0.25
    box_w = (width - label_in - 0.15 - gap * (panels - 1)) / panels
    if box_w < 0.8:
        raise InputError(f"width {width:g} inches leaves less than 0.8 inches per panel; give at least "
                         f"{label_in + 0.15 + gap * (panels - 1) + 0.8 * panels:.1f}")
    H = foot_in + axis_in + box_h + 0.22 + title_in
    fig = Figure(figsize=(width, H))
    FigureCanvasAgg(fig)
    y = np.arange(n)[::-1].astype(float)
    names = [f"L{l} H{h}" for l, h in pairs]
    bottom = foot_in + axis_in

    def axes(k):
        ax = fig.add_axes(((label_in + k * (box_w + gap)) / width, bottom / H, box_w / width, box_h / H))
        ax.set_yticks(y)
        ax.set_yticklabels(names if k == 0 else [], fontsize=fs)
        ax.set_ylim(-0.6, n - 0.4)
        ax.axvline(0, color="black", linewidth=0.6)
        ax.grid(axis="x", linewidth=0.3, color="#dddddd")
        ax.set_axisbelow(True)
        ax.tick_params(labelsize=fs, length=2, pad=1)
        return ax

    def legend(ax, handles):
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.45 / box_h), ncol=1,
                  frameon=False, fontsize=fs, handlelength=1.0, borderaxespad=0, labelspacing=0.2)

    ax0 = axes(0)
    ax0.barh(y, rows["share"], height=0.6, color=EFFECT_COLOURS["share"])
    ax0.set_xlabel("head share $\\Sigma_j\\, C_{ij}^h$\n(fraction of its layer's output)", fontsize=fs, labelpad=1)
    ax0.set_xlim(min(0.0, float(rows["share"].min()) * 1.1), max(0.05, float(rows["share"].max()) * 1.1))
    ax0.set_title("share (not a cause)", fontsize=fs + 0.5, pad=3)
    ax0.set_ylabel("head H of layer L", fontsize=fs, labelpad=1)
    ax1 = axes(1)
    h = 0.38
    b1 = ax1.barh(y + h / 2, rows["direct_effect"], height=h, color=EFFECT_COLOURS["direct"], label="direct effect")
    b2 = ax1.barh(y - h / 2, rows["total_effect"], height=h, color=EFFECT_COLOURS["total"],
                  label=f"total effect ({a.get('ablation', 'zero')} ablation)")
    ax1.set_xlabel(f"effect on {metric}\n({unit})", fontsize=fs, labelpad=1)
    ax1.set_title("effect on the answer", fontsize=fs + 0.5, pad=3)
    legend(ax1, [b1, b2])
    if places:
        ax2 = axes(2)
        hp = 0.76 / len(places)
        got = patching.set_index(["at", "layer", "head"])["share_of_gap"]
        handles = []
        for k, where in enumerate(places):
            vals = [float(got.get((where, l, hh), np.nan)) for l, hh in pairs]
            handles.append(ax2.barh(y + 0.38 - hp * (k + 0.5), vals, height=hp, color=EFFECT_COLOURS.get(where, None),
                                    label=f"patched at the {'changed tokens' if where == 'changed' else where}"
                                    if where != "all" else "patched everywhere"))
        ax2.set_xlabel("share of the gap $m_b - m_a$\nmoved by patching the head", fontsize=fs, labelpad=1)
        ax2.set_title("patching (b into a)", fontsize=fs + 0.5, pad=3)
        legend(ax2, handles)
    fig.suptitle(title_text, fontsize=fs + 1.5, y=1 - 0.05 / H, va="top")
    fig.text(0.01, 0.04 / H, foot_text, fontsize=fs, ha="left", va="bottom", color="#444444")
    legible(fig)
    if path is None:
        return fig
    return _write(fig, path)


def run_figures(out_dir: str | Path, fmt: str = "png") -> list[Path]:
    """Draw the figures of the finished run in ``out_dir`` again from its tables, in format ``fmt``
    (e.g. ``"pdf"``), beside the run's own files; returns their paths. The run itself is unchanged
    (its manifest covers the files it wrote)."""
    import importlib
    import json

    from attngeom.reports.common import check_format

    out = Path(out_dir)
    fmt = check_format(fmt)
    try:
        command = json.loads((out / "run.json").read_text(encoding="utf-8"))["command"]
    except (OSError, ValueError, KeyError):
        raise InputError(f"{out} holds no finished attngeom run (run.json)") from None
    if command not in RUN_FIGURES:
        raise InputError(f"{out} holds an attngeom {command} run; run_figures draws those of "
                         f"{', '.join(RUN_FIGURES)} (analyze: attngeom analyze --figure-format, or trace.plot_token_map)")
    return importlib.import_module(f"attngeom.reports.{command}").render(out, fmt)
