"""The plotting API: figures for a paper from a :class:`~attngeom.traces.trace.Trace` or from a run's
tables, in any format matplotlib writes (the file name's suffix: ``.pdf``, ``.svg``, ``.png``, ...).

- :func:`token_map` (also ``trace.plot_token_map(...)``) — one map of one layer, token level or one
  head, any metric of :mod:`attngeom.metrics.registry`, cropped to a token range, one column wide
  by default (:data:`~attngeom.reports.common.COLUMN_WIDTH_IN` inches), token labels of
  :data:`~attngeom.reports.common.MIN_FONT_PT` points (every k-th when they would not fit), a title,
  axis labels (query token, source token), a colour bar naming the metric and its scale
  (:func:`scale_label`) and a line between prompt and answer.
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
