"""The analyze figures: laid out by hand (no layout engine, one canvas for the head grid) and their
drawing cost relative to a figure of one image (CPU time, never an absolute time)."""

import time

import numpy as np
import pytest

from attngeom.reports import analyze as rep


class FakeLayer:
    """What the figure functions read from a LayerTrace, from random causal attention."""

    def __init__(self, heads: int, T: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(heads, T, T))
        x[:, np.triu(np.ones((T, T), bool), 1)] = -np.inf
        a = np.exp(x - x.max(-1, keepdims=True))
        self.attention = (a / a.sum(-1, keepdims=True)).astype(np.float32)
        self.contribution = (self.attention * rng.normal(1, 1, a.shape)).astype(np.float32)
        self.index, self.num_heads = 3, heads

    def token_score(self, name):
        return self.attention.mean(0) if name == "attention" else self.contribution.sum(0)


@pytest.fixture
def saved_figures(monkeypatch):
    figs = []
    real = rep._save

    def keep(fig, path):
        figs.append(fig)
        real(fig, path)
    monkeypatch.setattr(rep, "_save", keep)
    return figs


def test_figures_are_laid_out_by_hand(tmp_path, saved_figures):
    lt = FakeLayer(9, 20)
    tokens = [f"t{i}" for i in range(20)]
    rep.draw_token_maps(lt, tokens, tmp_path / "m.png")
    rep.draw_head_grid(lt, tokens, tmp_path / "h.png")
    for fig in saved_figures:
        assert fig.get_layout_engine() is None
        assert fig.dpi <= 150
    maps, grid = saved_figures
    assert len(maps.axes) == 8                      # 4 maps + their colour bars
    assert len(grid.axes) == 3                      # one canvas for all 18 maps + 2 colour bars
    assert len(grid.axes[0].images) == 18


def _cpu(f, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        f()
        best = min(best, time.process_time() - t)
    return best


@pytest.mark.parametrize("T", [16, 141])
def test_figure_cost_relative_to_a_single_image(tmp_path, T):
    """Absolute times are meaningless on a shared machine; CPU time relative to saving a figure with
    one image is stable. Measured (2-core machine under load): the per-head grid ~5x and the token
    maps 6x (T=141) to 11x (T=16, token labels) such a figure."""
    lt = FakeLayer(9, T)
    tokens = [f"tok{i}" for i in range(T)]

    def baseline():
        fig = rep._figure(6, 6, 100)
        fig.add_subplot().imshow(lt.attention[0])
        rep._save(fig, tmp_path / "b.png")

    for f in (baseline, lambda: rep.draw_head_grid(lt, tokens, tmp_path / "h.png"),
              lambda: rep.draw_token_maps(lt, tokens, tmp_path / "m.png")):
        f()                                          # warm: fonts, mathtext
    base = _cpu(baseline)
    grid = _cpu(lambda: rep.draw_head_grid(lt, tokens, tmp_path / "h.png"))
    maps = _cpu(lambda: rep.draw_token_maps(lt, tokens, tmp_path / "m.png"))
    assert grid < 12 * base, (grid, base)
    assert maps < 18 * base, (maps, base)


def test_kvtasks_figure_gives_every_policy_of_a_panel_its_own_colour():
    """matplotlib's default cycle of 10 drew four of the 13 baselines in a colour already used."""
    from attngeom.reports.kvtasks import MARKERS, styles

    s = styles(20)
    assert len({c for c, _ in s}) == 20
    assert [m for _, m in s[:len(MARKERS)]] == list(MARKERS)
    assert s[:13] == styles(13)


class FakeTrace:
    """What :func:`attngeom.reports.plot.token_map` reads from a Trace."""

    def __init__(self, T: int = 12):
        layer = FakeLayer(4, T)
        layer.metric = lambda name: layer.attention if name == "attention" else layer.contribution
        self.layers, self.model_name, self.prompt_length = [layer], "tiny-model", T
        self.tokens = [f" tok{i}" for i in range(T)]


def _fonts(pdf: bytes) -> set[str]:
    """The font subtypes of a PDF: its objects, and its compressed streams inflated (object streams)."""
    import re
    import zlib

    chunks = [pdf]
    for m in re.finditer(rb"stream\r?\n(.*?)endstream", pdf, re.S):
        try:
            chunks.append(zlib.decompress(m.group(1)))
        except zlib.error:
            pass
    return {s.decode() for c in chunks for s in re.findall(rb"/Subtype\s*/(Type3|TrueType|CIDFontType2|Type1|Type0)", c)}


def test_vector_figures_embed_truetype_and_keep_text(tmp_path):
    """Journals' checks (ACM, IEEE) reject Type 3 fonts; SVG text drawn as paths cannot be edited or
    searched. The paper figure as PDF embeds TrueType only, as SVG keeps its text as <text>; the same
    figure saved with matplotlib's default (Type 3) is caught by the same reading."""
    from attngeom.reports import plot

    pdf = plot.token_map(FakeTrace(), 3, "contribution", path=tmp_path / "m.pdf")
    fonts = _fonts(pdf.read_bytes())
    assert "Type3" not in fonts and fonts & {"TrueType", "CIDFontType2"}, fonts
    svg = plot.token_map(FakeTrace(), 3, "contribution", path=tmp_path / "m.svg").read_text(encoding="utf-8")
    assert svg.count("<text") >= 12 and "tok1" in svg and "source token" in svg
    import matplotlib

    with matplotlib.rc_context({"pdf.fonttype": 3}):
        plot.token_map(FakeTrace(), 3, "contribution").savefig(tmp_path / "type3.pdf")
    assert "Type3" in _fonts((tmp_path / "type3.pdf").read_bytes())


def test_the_paper_figure_labels_its_axes_and_names_its_colour_scale():
    from attngeom.reports import plot

    fig = plot.token_map(FakeTrace(), 3, "contribution")
    ax, cax = fig.axes
    assert ax.get_xlabel() == "source token $j$" and ax.get_ylabel() == "query token $i$"
    assert "signed" in cax.get_ylabel() and "99.5th pct" in cax.get_ylabel()      # contributions are signed
    fig = plot.token_map(FakeTrace(), 3, "attention", head=1)
    assert "signed" not in fig.axes[1].get_ylabel() and r"\sqrt" in fig.axes[1].get_ylabel()


def test_run_figures_name_the_model_and_the_sample_with_the_caveat_below_ten(tmp_path):
    import json

    from attngeom.reports.common import figure_note, run_note, save_figure

    (tmp_path / "summary.json").write_text(json.dumps({"command": "sinks", "window": 128, "windows": 4,
                                                        "models": {"tiny-model": {}}}))
    note = run_note(tmp_path)
    assert note == "tiny-model; windows of 128 tokens; 4 windows (fewer than 10: an example, not an estimate)"
    (tmp_path / "summary.json").write_text(json.dumps({"model": "m", "windows": [12, 12], "calibration_windows": 2,
                                                        "heldout_windows": 10}))
    assert run_note(tmp_path) == "m; 12 windows, 2 calibration, 10 held out (fewer than 10: an example, not an estimate)"
    (tmp_path / "summary.json").write_text(json.dumps({"model": "m", "windows": 12}))
    assert run_note(tmp_path) == "m; 12 windows"
    fig = rep._figure(3, 2, 100)
    fig.add_subplot().plot([0, 1])
    with figure_note(note):
        save_figure(fig, tmp_path / "f.svg")
    assert "fewer than 10" in (tmp_path / "f.svg").read_text(encoding="utf-8")


def test_the_kvtasks_figure_names_model_length_mode_and_examples(tmp_path, monkeypatch):
    import json

    import pandas as pd

    from attngeom.reports import kvtasks

    rows = [{"task": "t", "policy": p, "ratio": r, "examples": 6, "accuracy": a, "low": float("nan"),
             "high": float("nan")} for p, a in (("full", 0.5), ("h2o", 0.3), ("contribution", 0.2)) for r in (0.5, 0.75)]
    pd.DataFrame(rows).to_parquet(tmp_path / "summary.parquet")
    (tmp_path / "summary.json").write_text(json.dumps({"model": "tiny-model", "length": 4096, "mode": "query-aware"}))
    figs = []
    real = kvtasks.save_figure
    monkeypatch.setattr(kvtasks, "save_figure", lambda fig, path, **kw: (figs.append(fig), real(fig, path, **kw))[1])
    kvtasks.render(tmp_path, "png")
    title = figs[0]._suptitle.get_text()
    assert "tiny-model, 4,096 tokens, query-aware" in title and "6 examples: fewer than 10" in title


def test_the_kvcache_figure_gives_every_policy_its_own_colour_and_marker(tmp_path, monkeypatch):
    """Ten policies and more: matplotlib's default cycle of 10 would repeat a colour."""
    import pandas as pd

    from attngeom.reports import kvcache

    names = [f"p{i:02d}" for i in range(13)]
    rows = [{"policy": p, "budget": b, "ppl": 10.0 + i + b / 100, "ppl_low": float("nan"), "ppl_high": float("nan"),
             "windows": 4} for i, p in enumerate(["full", *names]) for b in (8, 16)]
    figs = []
    real = kvcache.save_figure
    monkeypatch.setattr(kvcache, "save_figure", lambda fig, path, **kw: (figs.append(fig), real(fig, path, **kw))[1])
    kvcache.fig_ppl(pd.DataFrame(rows), tmp_path / "p.png")
    from matplotlib.colors import to_hex

    lines = [c.lines[0] for c in figs[0].axes[0].containers]        # one errorbar container per policy
    assert len(lines) == 13 and len({to_hex(line.get_color()) for line in lines}) == 13
    assert len({line.get_marker() for line in lines}) > 1


def test_the_head_effects_figure_sets_shares_beside_effects_and_patching(tmp_path, tiny_llama):
    """plot.head_effects on a tiny model's tables: one row per head in the table's order, each panel's
    bars the table's numbers (share; direct and total effect; share of the gap by place patched), axes
    labelled with their units, legends below the panels (off the data), title naming model and texts;
    written as PNG and as a PDF with TrueType fonts only; a table without a contrast is in nats."""
    import pandas as pd

    from attngeom.errors import InputError, OutputError
    from attngeom.reports import plot
    from attngeom.traces.compare import patch_heads
    from attngeom.traces.effects import head_effects

    a, b = "The cat sat on the mat", "The dog sat on the mat"
    eff = head_effects(tiny_llama, a, "m", contrast="d", top=5)
    pat = patch_heads(tiny_llama, a, b, "m", contrast="d")
    fig = plot.head_effects(eff, pat, model="tiny-llama", text=a, text_b=b)
    share, effect, patched = fig.axes
    assert [t.get_text() for t in share.get_yticklabels()] == [f"L{l} H{h}" for l, h in zip(eff["layer"], eff["head"])]
    np.testing.assert_allclose([p.get_width() for p in share.patches], eff["share"])
    direct, total = effect.containers
    np.testing.assert_allclose([p.get_width() for p in direct], eff["direct_effect"])
    np.testing.assert_allclose([p.get_width() for p in total], eff["total_effect"])
    gap = pat.set_index(["at", "layer", "head"])["share_of_gap"]
    for where, bars in zip(("changed", "prediction"), patched.containers):
        np.testing.assert_allclose([p.get_width() for p in bars],
                                   [gap[(where, l, h)] for l, h in zip(eff["layer"], eff["head"])])
    assert "z(m) − z(d)" in effect.get_xlabel() and "logit units" in effect.get_xlabel()
    assert "share" in share.get_xlabel() and "gap" in patched.get_xlabel() and share.get_ylabel()
    title = fig._suptitle.get_text().replace("\n", " ")
    assert "tiny-llama" in title and a in title and b in title
    assert any("zero ablation" in t.get_text() for t in fig.texts)
    fig.canvas.draw()
    for ax in (effect, patched):
        legend, box = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert legend.y1 < box.y0 and len(ax.get_legend().get_texts()) == 2
    png = plot.head_effects(eff, pat, path=tmp_path / "e.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fonts = _fonts(plot.head_effects(eff, pat, path=tmp_path / "e.pdf").read_bytes())
    assert "Type3" not in fonts and fonts & {"TrueType", "CIDFontType2"}, fonts
    svg = plot.head_effects(eff, path=tmp_path / "e.svg").read_text(encoding="utf-8")
    assert "logit units" in svg and "L" in svg
    alone = head_effects(tiny_llama, a, "m", top=3)
    fig = plot.head_effects(alone, heads=[(int(alone["layer"][2]), int(alone["head"][2]))])
    assert len(fig.axes) == 2 and "nats" in fig.axes[1].get_xlabel() and "log P(m)" in fig.axes[1].get_xlabel()
    assert len(fig.axes[0].patches) == 1
    for bad, kw, match in ((pd.DataFrame(), {}, "head_effects"), (eff, {"heads": [(99, 0)]}, "not rows"),
                           (eff, {"patching": eff}, "patch_heads"), (eff, {"width": 1.0}, "width")):
        with pytest.raises(InputError, match=match):
            plot.head_effects(bad, **kw)
    with pytest.raises(OutputError, match="does not exist"):
        plot.head_effects(eff, path=tmp_path / "no" / "e.pdf")
    assert not (tmp_path / "no").exists()
