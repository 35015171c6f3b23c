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
        "heads": ["--window", "24", "--max-windows", "3", "--calib-windows", "1", "--few-windows"],
        "kvcache": ["--window", "40", "--max-windows", "2", "--policies", "full,streamingllm,h2o,window",
                    "--budgets", "8,16"],
        "faithfulness": ["--window", "24", "--max-windows", "2", "--ratios", "0.3,0.6"],
    }
    for name, extra in cmds.items():
        assert main([name, *common, *extra, "--out", str(d / name)]) == 0, name
    from attngeom.kvcache.ruler import Example, write_jsonl

    examples = write_jsonl([Example("toy", i, 0, "the key is abc. " * 3, "\nWhat is the key?", " The key is",
                                    ("abc",), 4, 16) for i in range(3)], d / "examples.jsonl")
    assert main(["kvtasks", "--model", str(tiny_llama_dir), "--examples-file", str(examples), "--policies",
                 "h2o,snap_contribution", "--ratios", "0.5,0.75", "--no-progress", "--no-figures",
                 "--out", str(d / "kvtasks")]) == 0
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


def test_faithfulness_figure_is_one_column_wide(runs, saved):
    from attngeom.reports.common import COLUMN_WIDTH_IN

    (path,) = plot.run_figures(runs / "faithfulness", "pdf")
    (name, smallest, texts, _), = saved
    assert path.name == "faithfulness.pdf" and smallest >= MIN_FONT_PT
    assert any("Faithfulness of token rankings" in t for t in texts)
    assert {"attention", "contribution"} <= set(texts)                     # the legend names the metrics
    import re

    width_pt = float(re.search(rb"/MediaBox \[ *0 0 ([0-9.]+)", path.read_bytes()).group(1))
    assert width_pt == pytest.approx(COLUMN_WIDTH_IN * 72, abs=1)


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
    """The README's table of what each command writes: {first cell: {column: names}}; each column's
    names written always, and under ``+column`` those written only with an option (``(+ ...)``)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    rows = text.split("<!-- outputs:", 1)[1].split("\n\n", 1)[0].splitlines()[3:]
    out = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        always = [set(re.findall(r"`([^`]+)`", c.split("(+")[0])) for c in cells]
        extra = [set(re.findall(r"`([^`]+)`", c.split("(+", 1)[1])) if "(+" in c else set() for c in cells]
        cols = ("tables", "figures", "report", "other")
        out[next(iter(always[0]))] = {**dict(zip(cols, always[1:])),
                                      **{f"+{c}": {n for n in e if not n.startswith("--")}
                                         for c, e in zip(cols, extra[1:])}}
    return out


def _listed_files(listed: dict, optional: bool = False, figures: bool = True) -> set[str]:
    """The file names a README row promises (figures as PNG; ``{L}`` stays a pattern), with the
    optional ones when ``optional``."""
    names = set()
    for col, suffix in (("tables", ".parquet"), ("figures", ".png"), ("report", ""), ("other", "")):
        if col == "figures" and not figures:
            continue
        for n in listed[col] | (listed[f"+{col}"] if optional else set()):
            names.add(n + suffix if n != "none" else None)
    return names - {None}


def _written(d) -> set[str]:
    """What a run wrote into its folder, besides the manifest and the checkpoint: the files its
    manifest lists (figures drawn again later by other tests are not the run's), each of them there."""
    files = set(json.loads((d / "run.json").read_text())["files"])
    assert all((d / f).is_file() for f in files)
    return files


def _same(written: set[str], listed: set[str], where: str) -> None:
    import re

    patterns = [re.compile(re.escape(n).replace(r"\{L\}", r"\d+") + "$") for n in listed]
    unlisted = {f for f in written if not any(p.match(f) for p in patterns)}
    missing = {n for n, p in zip(listed, patterns) if not any(p.match(f) for f in written)}
    assert not unlisted and not missing, f"{where}: written but not in README {unlisted}; in README, not written {missing}"


@pytest.mark.parametrize("command", ["sinks", "selection", "heads", "kvcache", "faithfulness"])
def test_the_readme_lists_what_each_command_writes(runs, command):
    listed = _readme_outputs()[command]
    d = runs / command
    _same(_written(d), _listed_files(listed, figures=False), command)      # the runs are --no-figures
    assert listed["report"] == {"report.md"} and listed["other"] == {"summary.json"}
    report = (d / "report.md").read_text()
    assert f"# attngeom {command}" in report and "## Results" in report and "| measure | value |" in report
    if command in plot.RUN_FIGURES:
        assert {p.stem for p in plot.run_figures(d, "png")} == listed["figures"]


ONE_TEXT = "The cat sat on the mat."


@pytest.mark.parametrize("row, argv, optional", [
    ("analyze", ["analyze", "--text", ONE_TEXT, "--layers", "0", "--no-progress"], False),
    ("analyze", ["analyze", "--text", ONE_TEXT, "--layers", "0,1", "--generate", "2", "--no-progress"], True),
    ("analyze --data F --generate N", ["analyze", "--data", "{prompts}", "--fields", "prompt", "--generate", "2",
                                       "--no-progress"], False),
    ("explore", ["explore", "--text", ONE_TEXT, "--no-progress"], False),
    ("compare", ["compare", "--text", ONE_TEXT, "--text-b", "The dog sat on the mat."], False),
    ("kvtasks", ["kvtasks", "--examples-file", "{examples}", "--policies", "h2o,snap_contribution", "--ratios", "0.5",
                 "--no-progress"], False),
    ("claims", ["claims", "--data", "{corpus}", "--window", "16", "--max-windows", "4", "--ns", "2", "--repeats", "1",
                "--bootstrap", "100", "--skip", "faithfulness,heads", "--no-progress"], False),
])
def test_the_readme_lists_what_the_other_commands_write(tiny_llama_dir, tmp_path, row, argv, optional):
    """The rows of README's outputs table that the corpus runs above do not cover: each run writes
    exactly the files its row lists (figures drawn, as PNG), and a readable report.md."""
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "the cat sat"}\n{"prompt": "a dog ran"}\n')
    (tmp_path / "corpus.txt").write_text(TEXT * 4)
    from attngeom.kvcache.ruler import Example, write_jsonl

    write_jsonl([Example("toy", i, 0, "the key is abc. " * 3, "\nWhat is the key?", " The key is", ("abc",), 4, 16)
                 for i in range(2)], tmp_path / "examples.jsonl")
    argv = [a.format(prompts=tmp_path / "prompts.jsonl", corpus=tmp_path / "corpus.txt",
                     examples=tmp_path / "examples.jsonl") for a in argv]
    out = tmp_path / "out"
    assert main([*argv, "--model", str(tiny_llama_dir), "--out", str(out)]) == 0
    listed = _readme_outputs()[row]
    _same(_written(out), _listed_files(listed, optional), " ".join(argv[:2]))
    assert "report.md" in listed["report"]
    report = (out / "report.md").read_text()
    assert report.startswith(f"# attngeom {argv[0]}") and report.count("\n") < 80
