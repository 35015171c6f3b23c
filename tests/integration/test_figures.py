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
