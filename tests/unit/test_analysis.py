"""attngeom.analysis.experiment: the single-text analysis' windows, per-layer sink aggregates and top tokens."""

import pandas as pd
import pytest

from attngeom.analysis.experiment import add_input_positions, cut_windows, per_layer_sinks, top_tokens


def test_cut_windows_cover_every_token_with_bos_repeated():
    ids = [1] + list(range(10, 20))                       # BOS then 10 tokens
    wins, has_bos = cut_windows(ids, window=5, stride=None, bos=1)
    assert has_bos and all(w[0] == 1 for _, w in wins)
    covered = {off + p for off, w in wins for p in range(1, len(w))}
    assert covered == set(range(1, len(ids)))             # every token after BOS, at its input position
    for off, w in wins:
        assert [ids[off + p] for p in range(1, len(w))] == w[1:]
    tokens = pd.DataFrame([{"text": k, "position": p, "token_id": t} for k, (_, w) in enumerate(wins)
                           for p, t in enumerate(w)])
    add_input_positions(tokens, wins, has_bos)
    assert list(tokens.columns) == ["text", "position", "input_position", "token_id"]
    assert all(ids[i] == t for i, t in zip(tokens["input_position"], tokens["token_id"]))   # BOS -> position 0
    wins, has_bos = cut_windows(list(range(10, 17)), window=4, stride=None, bos=1)
    assert not has_bos and sum(len(w) for _, w in wins) == 7


def test_per_layer_sinks_are_means_minima_maxima_and_sums_over_heads():
    heads = pd.DataFrame({"layer": [1, 1, 0, 0], "head": [0, 1, 0, 1], "sink_rate": [0.2, 0.6, 0.1, 0.3],
                          "sink_contribution": [0.1, -0.3, 0.0, 0.4], "sink_contribution_inter": [0.25, 0.5, 0.1, 0.2]})
    got = per_layer_sinks(heads)
    assert [r["layer"] for r in got] == [0, 1]
    assert got[1]["sink_attention"] == pytest.approx(0.4) and got[1]["sink_attention_min"] == 0.2
    assert got[1]["sink_contribution_max"] == 0.1 and got[1]["sink_contribution_min"] == -0.3
    assert got[0]["sink_contribution_to_layer_output"] == pytest.approx(0.3)


def test_top_tokens_rank_only_well_seen_positions():
    T = 40
    tokens = pd.DataFrame({"text": 0, "layer": 2, "position": range(T), "input_position": range(T),
                           "token": [f"t{i}" for i in range(T)],
                           "contribution_received": [float(i) for i in range(T)],
                           "attention_received": [float(T - i) for i in range(T)]})
    got = top_tokens(pd.concat([tokens, tokens.assign(layer=3)]), [T], 2, top_k=3)
    # positions seen by fewer than max(1, min(8, 40 // 2), 40 // 4) = 10 queries are not ranked
    assert got["min_seen_by"] == 10 and got["layer"] == 2
    assert [r["position"] for r in got["by_contribution_received"]] == [30, 29, 28]
    assert [r["position"] for r in got["by_attention_received"]] == [0, 1, 2]
    assert "window" not in got["by_attention_received"][0]
    two = top_tokens(pd.concat([tokens, tokens.assign(text=1)]), [T, T], 2, top_k=2)
    assert [(r["window"], r["position"]) for r in two["by_contribution_received"]] == [(0, 30), (1, 30)]
