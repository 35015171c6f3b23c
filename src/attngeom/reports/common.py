"""Shared figure settings: the Agg backend (no display needed), resolution, formats, the smallest
text size, and saving.

Every figure attngeom draws is saved by :func:`save_figure`, in the format its file name ends with
(any format matplotlib writes: PNG, PDF, SVG, EPS, ...; :func:`check_format`), with TrueType fonts in
PDF and PostScript and text as text in SVG (:data:`FONT_RC`). Sizes are set in
points at the saved size of the figure: no text is smaller than :data:`MIN_FONT_PT` (7 pt, legible
at one column of a paper when the figure is printed at the size it was saved at)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from attngeom.errors import InputError  # noqa: E402

FONT_RC = {"pdf.fonttype": 42, "ps.fonttype": 42, "svg.fonttype": "none"}
"""What journals' checks ask of a vector figure: TrueType (Type 42) fonts embedded in PDF and
PostScript, never Type 3, and text kept as text in SVG (not paths). :func:`save_figure` writes under it."""
DPI = 150
MIN_FONT_PT = 7.0
"""The smallest text size of a saved figure, in points at its saved size."""
PNG_COMPRESSION = 3
COLUMN_WIDTH_IN = 3.3
"""One column of a two-column paper, in inches: the default width of :mod:`attngeom.reports.plot`."""


def formats() -> list[str]:
    """The file formats matplotlib writes here (``png``, ``pdf``, ``svg``, ``eps``, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def check_format(fmt: str) -> str:
    """``fmt`` lower-cased when matplotlib writes it (pgf only where its LaTeX program is installed: it
    draws through it), else one-line :class:`InputError`."""
    f = str(fmt).lower().lstrip(".")
    if f not in formats():
        raise InputError(f"unknown figure format {fmt!r}; matplotlib writes {', '.join(formats())}")
    if f == "pgf":                                   # matplotlib writes pgf through a LaTeX program
        import shutil

        from matplotlib import rcParams

        tex = rcParams["pgf.texsystem"]
        if shutil.which(tex) is None:
            raise InputError(f"--figure-format pgf needs LaTeX ({tex}), which is not installed here; use pdf or svg")
    return f


def legible(fig, minimum: float = MIN_FONT_PT) -> None:
    """Raise every text of ``fig`` smaller than ``minimum`` points to ``minimum``."""
    from matplotlib.text import Text

    for t in fig.findobj(Text):
        if t.get_text() and t.get_fontsize() < minimum:
            t.set_fontsize(minimum)


def _plain(value, _pos=None) -> str:
    return f"{value:g}"


def tidy_axes(fig) -> None:
    """Ticks a reader takes in at once, on every axes of ``fig``: log and symlog axes in plain
    numbers (``60``, not ``6×10¹``; ``-100``, not ``−10²``; minor ticks labelled too when fewer than two major ticks are in view), and a linear axis labelled
    "layer ..." ticked at whole layers only."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

    for ax in fig.axes:
        for axis, lim in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            if axis.get_scale() in ("log", "symlog"):
                axis.set_major_formatter(FuncFormatter(_plain))
                lo, hi = sorted(lim)
                majors = [t for t in axis.get_majorticklocs() if lo <= t <= hi]
                axis.set_minor_formatter(FuncFormatter(_plain) if len(majors) < 2 else NullFormatter())
            elif axis.get_label_text().strip().lower().startswith("layer") and axis.get_scale() == "linear":
                axis.set_major_locator(MaxNLocator(integer=True))


def legend_outside(ax, *args, **kw):
    """``ax.legend(...)`` placed right of the axes, off the data (the layout makes room for it); ``loc``
    and ``bbox_to_anchor`` given by the caller are overridden."""
    kw.pop("loc", None)
    kw.pop("bbox_to_anchor", None)
    kw.setdefault("frameon", False)
    kw.setdefault("borderaxespad", 0.3)
    return ax.legend(*args, loc="upper left", bbox_to_anchor=(1.01, 1.0), **kw)


SMALL_SAMPLE = 10
"""Fewer independent windows (or examples) than this: no bootstrap interval, and every figure or
count resting on them says so (:func:`sample_note`)."""


def sample_note(n: int | None, unit: str = "windows") -> str:
    """The sample a figure rests on, for its title: ``"12 windows"``, or with the caveat below
    :data:`SMALL_SAMPLE` (``"4 windows: fewer than 10, an example, not an estimate"``); "" when unknown."""
    if n is None:
        return ""
    n = int(n)
    return f"{n} {unit}" + (f": fewer than {SMALL_SAMPLE}, an example, not an estimate" if n < SMALL_SAMPLE else "")


_NOTE: list[str] = [""]


def run_note(out_dir) -> str:
    """What a run's figures rest on, from its ``summary.json`` (written before its figures are
    drawn): model, window length, number of windows (examples, calibration windows) with the small-
    sample caveat (:func:`sample_note`); "" without a summary."""
    import json

    try:
        s = json.loads((Path(out_dir) / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    model = s.get("model") or next(iter(s.get("models") or {}), "") or (s.get("settings") or {}).get("model_name", "")
    parts = [str(model)] if model else []
    windows = s.get("windows")
    if isinstance(windows, list):                          # heads: the windows of each corpus, the first one's here
        windows = windows[0] if windows else None
    if isinstance(windows, dict):
        windows = windows.get("windows")
    if s.get("window"):
        parts.append(f"windows of {s['window']} tokens")
    counts = []
    if windows is not None:
        counts.append((int(windows), "windows"))
    elif s.get("examples") is not None:
        counts.append((int(s["examples"]), "examples"))
    elif s.get("units_done") is not None:                  # faithfulness: windows or examples done
        counts.append((int(s["units_done"]), f"{s.get('unit', 'window')}s"))
    for key, unit in (("calibration_windows", "calibration"), ("heldout_windows", "held out")):
        if s.get(key) is not None:                         # heads: the splits its numbers rest on
            counts.append((int(s[key]), unit))
    if counts:
        text = ", ".join(f"{n} {unit}" for n, unit in counts)
        if min(n for n, _ in counts) < SMALL_SAMPLE:
            text += f" (fewer than {SMALL_SAMPLE}: an example, not an estimate)"
        parts.append(text)
    return "; ".join(parts)


class figure_note:
    """``with figure_note(text):`` every figure :func:`save_figure` writes inside carries ``text`` in a
    line at its foot (what it rests on: :func:`run_note`)."""

    def __init__(self, text: str):
        self.text = text

    def __enter__(self):
        _NOTE.append(self.text)

    def __exit__(self, *exc):
        _NOTE.pop()


def current_note() -> str:
    """The text of the innermost :class:`figure_note` ("" outside one): for a figure laid out by hand,
    which places it itself."""
    return _NOTE[-1]


def _add_note(fig, layout: bool) -> float:
    """The current :class:`figure_note` at the foot of ``fig`` (a figure laid out by hand, ``layout``
    False, gets none: it has no room kept for it); the height (figure fraction) it takes."""
    note = _NOTE[-1]
    if not note or not layout:
        return 0.0
    H = fig.get_figheight()
    fig.text(0.01, 0.04 / H, note, fontsize=MIN_FONT_PT, ha="left", va="bottom", color="#444444")
    return (0.06 + 1.3 * MIN_FONT_PT / 72) / H if layout else 0.0


def save_figure(fig, path: Path, dpi: float | None = None, layout: bool = True) -> Path:
    """Lay out (``layout``: tight layout; figures laid out by hand pass False), tidy the ticks
    (:func:`tidy_axes`), make every text at least :data:`MIN_FONT_PT`, write in the format of ``path``'s suffix (raster formats at ``dpi``,
    default :data:`DPI`; PDF and SVG without a creation date, so the same figure gives the same
    file) and close (figures are not kept open between runs)."""
    path = Path(path)
    fmt = check_format(path.suffix or ".png")
    tidy_axes(fig)
    legible(fig)
    foot = _add_note(fig, layout)
    if layout:
        fig.tight_layout(rect=(0, foot, 1, 1))
    kwargs = {"pil_kwargs": {"compress_level": PNG_COMPRESSION}} if fmt == "png" else {}
    if fmt in ("pdf", "svg", "svgz", "eps", "ps"):
        kwargs["metadata"] = {"pdf": {"CreationDate": None}, "svg": {"Date": None},
                              "svgz": {"Date": None}}.get(fmt, {"CreationDate": None})
    with matplotlib.rc_context(FONT_RC):
        fig.savefig(path, dpi=dpi or DPI, format=fmt, **kwargs)
    plt.close(fig)
    return path
