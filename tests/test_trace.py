"""Streaming reducers agree with full traces; traces save and reload; bad input is refused."""

import numpy as np
import pytest
import torch

from attngeom.errors import InputError
from attngeom.reducers import HeadStats, TokenStats
from attngeom.trace import Trace, analyze, stream
from tiny_models import tiny_model

TEXTS = ["a b c d e f g h i j k l m n", "the cat sat on the mat while the dog slept", "x y z"]


@pytest.fixture(scope="module")
def handle():
    return tiny_model("qwen2")


def test_stream_matches_full_traces(handle):
    heads, tokens = HeadStats(), TokenStats()
    stream(handle, TEXTS, [heads, tokens], batch_size=2, progress=False, block_elements=100)
    traces = [analyze(handle, t) for t in TEXTS]
    hs = heads.result()
    ts = tokens.result()
    L = len(traces[0].layers)
    for layer in range(L):
        # per-head means over queries i > 0 of all texts
        sink = np.concatenate([tr.layers[layer].attention[:, 1:, 0] for tr in traces], axis=1).mean(1)
        ent = np.concatenate([
            -(np.where(a > 0, a * np.log(np.where(a > 0, a, 1)), 0)).sum(-1)[:, 1:]
            for a in (tr.layers[layer].attention for tr in traces)], axis=1).mean(1)
        c0 = np.concatenate([tr.layers[layer].contribution[:, 1:, 0] for tr in traces], axis=1).mean(1)
        sub = hs[hs.layer == layer].sort_values("head")
        assert np.allclose(sub.sink_rate, sink, atol=1e-5)
        assert np.allclose(sub.entropy, ent, atol=1e-4)
        assert np.allclose(sub.sink_contribution, c0, atol=1e-5)
        assert np.allclose(sub.winner_self + sub.winner_sink + sub.winner_other, 1)
        for k, tr in enumerate(traces):
            lt = tr.layers[layer]
            n = len(tr)
            rows = ts[(ts.text == k) & (ts.layer == layer)].sort_values("position")
            assert len(rows) == n
            for m in ("attention", "value_weighted", "output_normalized", "contribution"):
                score = lt.token_score(m)                             # [T, T]
                expected = score.sum(0) / (n - np.arange(n))          # mean over queries i >= j
                assert np.allclose(rows[f"{m}_received"], expected, atol=1e-5), m
            assert np.allclose(rows.sink_rate, lt.attention[:, :, 0].mean(0), atol=1e-6)
            assert np.allclose(rows.output_norm, lt.output_norm, rtol=1e-5)


def test_trace_save_and_load(handle, tmp_path):
    tr = analyze(handle, TEXTS[1])
    tr.save(tmp_path / "t")
    back = Trace.load(tmp_path / "t")
    assert back.tokens == tr.tokens and back.ids == tr.ids
    for a, b in zip(tr.layers, back.layers):
        assert np.array_equal(a.contribution, b.contribution)


def test_tokens_are_strings(handle):
    tr = analyze(handle, "hello world")
    assert len(tr.tokens) == len(tr.ids) and all(isinstance(t, str) for t in tr.tokens)
    assert tr.layers[0].contribution.dtype == np.float32
    H = handle.model.config.num_attention_heads
    assert tr.layers[0].contribution.shape == (H, len(tr), len(tr))
    assert tr.layers[0].head_output_norm.shape == (H, len(tr))


@pytest.mark.parametrize("bad", ["", "   \n", []])
def test_empty_input_refused(handle, bad):
    with pytest.raises(InputError):
        analyze(handle, bad)


def test_too_long_input_refused(handle):
    limit = handle.max_positions
    with pytest.raises(InputError, match="at most"):
        analyze(handle, torch.ones(limit + 1, dtype=torch.long))


def test_token_id_outside_vocab_refused(handle):
    with pytest.raises(InputError, match="vocabulary"):
        analyze(handle, [1, 2, 10**6])
