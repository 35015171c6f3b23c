"""Every figure attngeom draws, in each of PDF, SVG and PNG: the file is of that format, and no text
of the figure is smaller than MIN_FONT_PT at the saved size (read from the artist objects as the
figure is saved)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

from attngeom.cli import main
from attngeom.reports import analyze as rep
from attngeom.reports import plot
from attngeom.reports.common import MIN_FONT_PT
from attngeom.traces.trace import analyze

FORMATS = ("pdf", "svg", "png")
MAGIC = {"pdf": b"%PDF", "png": b"\x89PNG", "svg": b"<?xml"}
TEXT = "The sink collects attention but adds little.\nA second line, with\ttabs. " * 8


@pytest.fixture
def saved(monkeypatch):
    """The figures saved during a test: (path, smallest text size in points, the texts, their titles)."""
    out = []
    real = Figure.savefig

    def spy(self, fname, *a, **k):
        texts = [t for t in self.findobj(Text) if t.get_visible() and t.get_text().strip()]
        sizes = [t.get_fontsize() for t in texts]
        out.append((str(fname), min(sizes) if sizes else None, [t.get_text() for t in texts],
                    [ax.get_legend() is not None for ax in self.axes]))
        return real(self, fname, *a, **k)

    monkeypatch.setattr(Figure, "savefig", spy)
    return out


def check(saved, paths, fmt):
    assert saved, "nothing was saved"
    for p in paths:
        assert p.is_file() and p.read_bytes()[:5].startswith(MAGIC[fmt]), p
    for name, smallest, texts, _ in saved:
        assert smallest is not None and smallest >= MIN_FONT_PT, (name, smallest)
        assert texts, name


@pytest.fixture(scope="module")
def trace(tiny_llama):
    return analyze(tiny_llama, "The cat sat on the mat.\nThe dog slept.", layers=[0, 1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_analyze_figures_in_every_format(tiny_llama, trace, tmp_path, saved, fmt):
    import pandas as pd

    lt = trace.layers[0]
    paths = [tmp_path / rep.draw_token_maps(lt, trace.tokens, tmp_path / f"maps.{fmt}", title="t", divider=5),
             tmp_path / rep.draw_head_grid(lt, trace.tokens, tmp_path / f"heads.{fmt}", title="t", divider=5)]
    heads = pd.DataFrame([{"layer": l, "head": h, "sink_rate": 0.5, "sink_contribution": 0.1,
                           "sink_contribution_inter": 0.02, "queries": 10} for l in range(3) for h in range(4)])
    paths.append(tmp_path / rep.draw_sinks(heads, tmp_path / f"sinks.{fmt}", title="t"))
    check(saved, paths, fmt)
    # the per-head grid labels its tokens; newlines show as a visible glyph, never an empty box
    grid_texts = saved[1][2]
    assert rep.token_label("\n") == "↵" and any("↵" in t for t in grid_texts)
    assert any("prompt | answer" in t for t in saved[0][2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_plotting_api_one_column_wide(trace, tmp_path, saved, fmt):
    p = trace.plot_token_map(1, "contribution", tokens=slice(2, 9), path=tmp_path / f"one.{fmt}")
    q = trace.plot_token_map(0, "attention", head=1, path=tmp_path / f"head.{fmt}", title="my title")
    check(saved, [p, q], fmt)
    fig = trace.plot_token_map(1)
    assert isinstance(fig, Figure) and fig.get_size_inches()[0] == pytest.approx(3.3)
    assert "my title" in saved[1][2]


def test_plotting_api_crops_and_refuses_bad_ranges(trace):
    from attngeom.errors import InputError

    fig = trace.plot_token_map(0, tokens=(3, 7))
    ax = fig.axes[0]
    assert ax.images[0].get_array().shape == (4, 4)
    assert [t.get_text() for t in ax.get_yticklabels()][0] == rep.token_label(trace.tokens[3])
    with pytest.raises(InputError, match="select no token"):
        trace.plot_token_map(0, tokens=(5, 5))
    with pytest.raises(InputError, match="layer 7 is not in this trace"):
        trace.plot_token_map(7)
    with pytest.raises(InputError, match="unknown metric"):
        trace.plot_token_map(0, "nope")


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, tmp_path_factory):
    """One small finished run of each corpus command that draws, without figures."""
    d = tmp_path_factory.mktemp("runs")
    data = d / "c.txt"
    data.write_text(TEXT * 2)
    common = ["--model", str(tiny_llama_dir), "--data", str(data), "--no-progress", "--no-figures"]
    cmds = {
        "sinks": ["--window", "24", "--max-windows", "2"],
        "selection": ["--window", "24", "--max-windows", "2"],
        "heads": ["--window", "24", "--max-windows", "3", "--calib-windows", "1"],
        "kvcache": ["--window", "40", "--max-windows", "2", "--policies", "full,streamingllm,h2o,window",
                    "--budgets", "8,16"],
        "faithfulness": ["--window", "24", "--max-windows", "2", "--ratios", "0.3,0.6"],
    }
    for name, extra in cmds.items():
        assert main([name, *common, *extra, "--out", str(d / name)]) == 0, name
    return d


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("command", plot.RUN_FIGURES)
def test_run_figures_in_every_format(runs, command, fmt, saved):
    paths = plot.run_figures(runs / command, fmt)
    assert paths and all(p.suffix == f".{fmt}" for p in paths)
    check(saved, paths, fmt)
    for name, _, texts, legends in saved:
        if "kvcache" in name:
            assert any(legends), f"{name}: no legend"
            assert not any("×10" in t or "^{" in t for t in texts), f"{name}: exponent ticks"


def test_kvcache_figures_read_plainly(runs, saved):
    plot.run_figures(runs / "kvcache", "png")
    ppl = next(s for s in saved if "kvcache-ppl" in s[0])
    assert any("Perplexity under a KV-cache budget" in t for t in ppl[2])
    assert {"8", "16"} <= set(ppl[2])                        # the budgets themselves as ticks
    assert any("too few windows" in t for t in ppl[2])         # 2 windows: no interval drawn
    assert not any("time" in t.lower() for s in saved for t in s[2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_figure_format_option(tiny_llama_dir, tmp_path, fmt):
    data = tmp_path / "c.txt"
    data.write_text(TEXT)
    out = tmp_path / "f"
    assert main(["faithfulness", "--model", str(tiny_llama_dir), "--data", str(data), "--window", "24",
                 "--max-windows", "2", "--ratios", "0.5", "--figure-format", fmt, "--no-progress",
                 "--out", str(out)]) == 0
    assert (out / f"faithfulness.{fmt}").read_bytes()[:5].startswith(MAGIC[fmt])
    assert "faithfulness" in (out / "report.md").read_text()


def test_unknown_figure_format_is_one_line(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "bad"
    assert main(["sinks", "--model", str(tiny_llama_dir), "--data", str(tmp_path), "--figure-format", "docx",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown figure format 'docx'" in err[0] and not out.exists()


def test_analyze_writes_figures_in_the_format_asked(tiny_llama_dir, tmp_path):
    out = tmp_path / "a"
    assert main(["analyze", "--model", str(tiny_llama_dir), "--text", "The cat sat on the mat.", "--layers", "0,1",
                 "--figure-format", "svg", "--no-progress", "--out", str(out)]) == 0
    files = json.loads((out / "summary.json").read_text())["files"]
    figs = [f for f in files if f.rsplit(".", 1)[-1] in ("png", "svg", "pdf")]
    assert figs and all(f.endswith(".svg") for f in figs)
    assert all((out / f).read_bytes()[:5] == b"<?xml" for f in figs)


def test_texts_too_short_to_score_are_refused(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "short.csv"
    data.write_text("text\nthe cat\n")
    assert main(["sinks", "--model", str(tiny_llama_dir), "--data", str(data), "--no-progress",
                 "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a perplexity change needs at least 16" in err[0]
    assert not np.any([p.name == "summary.json" for p in (tmp_path / "s").rglob("*")])


def _readme_outputs() -> dict[str, dict[str, set[str]]]:
    """The README's table of what each command writes: {command: {column: names}}."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    rows = text.split("<!-- outputs:", 1)[1].split("\n\n", 1)[0].splitlines()[3:]
    out = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = [set(re.findall(r"`([^`]+)`", c.split("(+")[0])) for c in cells]
        out[next(iter(names[0]))] = {"tables": names[1], "figures": names[2], "report": names[3]}
    return out


@pytest.mark.parametrize("command", ["sinks", "selection", "heads", "kvcache", "faithfulness"])
def test_the_readme_lists_what_each_command_writes(runs, command):
    listed = _readme_outputs()[command]
    d = runs / command
    assert {p.stem for p in d.glob("*.parquet")} == listed["tables"]
    assert listed["report"] == {"report.md"} and (d / "report.md").is_file() and (d / "summary.json").is_file()
    report = (d / "report.md").read_text()
    assert f"# attngeom {command}" in report and "## Results" in report and "| measure | value |" in report
    if command in plot.RUN_FIGURES:
        assert {p.stem for p in plot.run_figures(d, "png")} == listed["figures"]
