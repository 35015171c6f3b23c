"""Head taxonomy (SPEC §6) on a tiny Llama whose layer-0 heads are forced, through their weights, to
attend to the current token, uniformly with a dominant sink value, or uniformly: the regimes and
alignments come out of the real forward pass and :class:`TaxonomyStats`."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from attngeom.heads.taxonomy import REGIMES, TaxonomyStats, corpus_agreement, regime_alignment, regime_shares, regimes_of, shares_by_depth, shares_by_layer
from attngeom.streaming import stream

from tiny_models import BOS_ID, tiny_model

TEXT = "abcdefghijklmnopqrstuvwxyz12"   # 29 tokens with BOS, all distinct
TEXT2 = "ZYXWVUTSRQPONMLKJIHGF"


def forced_llama():
    """Layer 0 of a tiny Llama (4 query heads, 2 KV heads, head_dim 16), edited so that

    - head 0 (KV 0) and head 3 (KV 1) attend to the current token: zero q/k weights, q/k biases
      ``c·e_0`` in the highest-frequency RoPE pair, so ``score(i, j) ∝ c² cos(i − j)``;
    - head 1 (KV 0) attends uniformly (zero q) and KV 0's value of the BOS token is huge;
    - head 2 (KV 1) attends uniformly and KV 1's value of the BOS token is zero.

    Expected regimes: Retriever, Mixer, Reset, Retriever."""
    h = tiny_model("llama", attention_bias=True)
    m = h.model
    attn = m.model.layers[0].self_attn
    d = attn.head_dim
    c = 200.0
    with torch.no_grad():
        emb = m.model.embed_tokens.weight
        emb[:, 0] = 0.0
        emb[BOS_ID] = 0.0
        emb[BOS_ID, 0] = 10.0                      # BOS lives on coordinate 0 only
        attn.q_proj.weight.zero_()
        attn.q_proj.bias.zero_()
        attn.k_proj.weight.zero_()
        attn.k_proj.bias.zero_()
        for head in (0, 3):
            attn.q_proj.bias[head * d] = c
        for kv in (0, 1):
            attn.k_proj.bias[kv * d] = c
        attn.v_proj.bias.zero_()
        attn.v_proj.weight[:d, 0] = 100.0         # KV 0: BOS value huge
        attn.v_proj.weight[d:, 0] = 0.0           # KV 1: BOS value zero
    return h


@pytest.fixture(scope="module")
def forced():
    return forced_llama()


@pytest.fixture(scope="module")
def forced_result(forced):
    tax = TaxonomyStats()
    stream(forced, [TEXT, TEXT2], [tax], layers=[0], batch_size=2, progress=False)
    return tax, tax.result()


def test_forced_heads_get_their_regimes(forced_result):
    _, df = forced_result
    assert list(df["regime"]) == ["Retriever", "Mixer", "Reset", "Retriever"]
    d = df.set_index("head")
    assert d.loc[0, "winner_self"] == 1.0 and d.loc[3, "winner_self"] == 1.0
    assert d.loc[1, "winner_sink"] == 1.0
    assert d.loc[2, "winner_other"] > 0.5 and d.loc[2, "winner_sink"] == 0.0
    n = len(TEXT) + 1 - 1 + len(TEXT2) + 1 - 1  # queries i >= 1 of both texts
    assert (df["queries"] == n).all()


def test_forced_heads_alignment(forced_result):
    _, df = forced_result
    d = df.set_index("head")
    assert d.loc[0, "align_self"] > 0.99 and d.loc[3, "align_self"] > 0.99     # output = own value
    assert d.loc[1, "align_sink"] > 0.95                                        # output = sink value
    al = regime_alignment(df)
    assert al["Retriever"]["heads"] == 2 and al["Retriever"]["align_self"] > 0.99
    assert al["Mixer"]["align_sink"] > 0.95
    assert al["Reset"]["align_self"] < 0.9


def test_projected_winner_norm_option(forced):
    tax = TaxonomyStats(winner_norm="projected")
    stream(forced, [TEXT], [tax], layers=[0], progress=False)
    df = tax.result()
    assert df.loc[df["head"] == 1, "regime"].item() == "Mixer"
    assert df.loc[df["head"] == 0, "regime"].item() == "Retriever"
    with pytest.raises(ValueError):
        TaxonomyStats(winner_norm="length")


def test_merge_equals_one_pass(forced):
    both = TaxonomyStats()
    stream(forced, [TEXT, TEXT2], [both], progress=False)
    a, b = TaxonomyStats(), TaxonomyStats()
    stream(forced, [TEXT], [a], progress=False)
    stream(forced, [TEXT2], [b], progress=False)
    merged = TaxonomyStats().merge(a).merge(b).result()
    ref = both.result()
    pd.testing.assert_frame_equal(merged, ref, check_exact=False, rtol=1e-6, atol=1e-7)


def test_plurality_ties_and_shares():
    df = pd.DataFrame({"layer": [0, 0, 1, 1, 2, 2], "head": [0, 1, 0, 1, 0, 1],
                       "winner_self": [0.5, 0.2, 0.4, 0.1, 0.34, 0.3],
                       "winner_sink": [0.5, 0.7, 0.2, 0.1, 0.33, 0.3],
                       "winner_other": [0.0, 0.1, 0.4, 0.8, 0.33, 0.4]})
    df["regime"] = regimes_of(df)
    assert list(df["regime"]) == ["Retriever", "Mixer", "Retriever", "Reset", "Retriever", "Reset"]
    assert regime_shares(df) == {"Retriever": 0.5, "Mixer": 1 / 6, "Reset": 1 / 3}
    by = shares_by_layer(df).set_index("layer")
    assert by.loc[1, "Retriever"] == 0.5 and by.loc[1, "Reset"] == 0.5
    depth = shares_by_depth(df, num_layers=3)
    assert depth["early"] == {"Retriever": 0.5, "Mixer": 0.5, "Reset": 0.0}


def test_corpus_agreement():
    a = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "regime": ["Mixer", "Reset", "Reset", "Retriever"]})
    b = a.copy()
    assert corpus_agreement(a, b)["agreement"] == 1.0 and corpus_agreement(a, b)["kappa"] == pytest.approx(1.0)
    b.loc[3, "regime"] = "Reset"
    r = corpus_agreement(a, b)
    assert r["agreement"] == 0.75 and r["confusion"]["Retriever"]["Reset"] == 1
    # kappa = (0.75 - pe) / (1 - pe), pe = sum_r p_a(r) p_b(r) = 0.25*0.25 + 0.5*0.75 + 0.25*0
    pe = 0.25 * 0.25 + 0.5 * 0.75
    assert r["kappa"] == pytest.approx((0.75 - pe) / (1 - pe))
    assert set(REGIMES) == set(r["confusion"])


# ------------------------------------------------------------------------------------------------
# CLI bad input (the heads command is exercised end to end in test_heads.py)
# ------------------------------------------------------------------------------------------------


