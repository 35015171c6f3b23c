"""LaProx (Mai & Kim, 2026, as its abstract describes it; attngeom.kvcache.policies.laprox): the
score by hand on two query heads sharing one key/value head (their terms adding and cancelling),
against the layer output recomputed with the entry zeroed on random grouped heads, split over
blocks, and the one cut over all layers and heads by hand."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from attngeom.kvcache.cache import kept_entries, pool_heads
from attngeom.kvcache.policies import EvictionContext, LaProx, get_policy

V = torch.tensor([[1.0, 0], [0, 1], [1, 1]])          # three entries of one key/value head, d = 2
A1 = torch.tensor([0.5, 0.25, 0.25])                   # the last query's attention, query head 1
A2 = torch.tensor([0.25, 0.25, 0.5])                   # query head 2


def _block(a, v, w_o, kv_head, q_start=0, lengths=None):
    """A captured block: ``a [B, H, Q, S]``, values per query head ``v [B, H, S, d]``, ``w_o [D, H·d]``."""
    B, H, Q, S = a.shape
    d = v.shape[-1]
    u = a @ v                                                                  # [B, H, Q, d]
    o = torch.einsum("bhqd,Dhd->bqD", u, w_o.reshape(w_o.shape[0], H, d))      # the layer output
    lengths = torch.full((B,), q_start + Q) if lengths is None else lengths
    return SimpleNamespace(a=a, q_start=q_start, k_start=0, v=v, output_sq=(o**2).sum(-1),
                           query_valid=torch.arange(q_start, q_start + Q)[None] < lengths[:, None],
                           state=SimpleNamespace(G_full=w_o.T @ w_o, kv_head=torch.as_tensor(kv_head)))


def test_laprox_scores_by_hand():
    """Window 1 (the last query), W_O^1 = I: with W_O^2 = I the heads add, a_j = (.75, .5, .75),
    o = .75(1,0) + .5(0,1) + .75(1,1) = (1.5, 1.25), ‖o‖² = 3.8125, s_j = a_j² ‖v_j‖² / ‖o‖²;
    with W_O^2 = −I they cancel, a_j = (.25, 0, −.25), o = (0, −.25), ‖o‖² = .0625: s = (1, 0, 2)."""
    a = torch.stack([A1, A2]).reshape(1, 2, 1, 3)
    v = V.expand(1, 2, 3, 2)
    eye = torch.eye(2)
    pol = LaProx(window=1)
    s = pol.step(_block(a, v, torch.cat([eye, eye], 1), [0, 0]), 1)
    want = torch.tensor([0.75**2 * 1, 0.5**2 * 1, 0.75**2 * 2]) / 3.8125
    torch.testing.assert_close(s.sum(1)[0], want)
    torch.testing.assert_close(pool_heads(s, 1, pol.pool)[0, 0] * 2, want)     # the mean over the two heads, x2
    s = pol.step(_block(a, v, torch.cat([eye, -eye], 1), [0, 0]), 1)
    torch.testing.assert_close(s.sum(1)[0], torch.tensor([1.0, 0.0, 2.0]))
    assert pol.step(_block(a, v, torch.cat([eye, eye], 1), [0, 0]), 5) is None   # the block is before the window


def test_laprox_is_the_relative_change_of_the_layer_output_with_the_entry_zeroed():
    """Random grouped heads (4 query heads, 2 key/value heads, causal, T = 9, window 4, read in two
    blocks): ``Σ_{h∈g} step_h`` is ``Σ_i ‖o_i − o_i^{(g, j zeroed)}‖² / ‖o_i‖²`` over the window,
    computed by zeroing each value and recomputing the layer output."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, d, D, w = 1, 4, 2, 9, 3, 5, 4
    logits = torch.randn(B, H, T, T, generator=g, dtype=torch.float64)
    a = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    value = torch.randn(B, Hkv, T, d, generator=g, dtype=torch.float64)
    w_o = torch.randn(D, H * d, generator=g, dtype=torch.float64)
    kv_head = torch.arange(H) // (H // Hkv)
    v = value[:, kv_head]

    def layer_output(val):
        u = a @ val[:, kv_head]
        return torch.einsum("bhqd,Dhd->bqD", u, w_o.reshape(D, H, d))

    o = layer_output(value)
    want = torch.zeros(B, Hkv, T, dtype=torch.float64)
    for kv in range(Hkv):
        for j in range(T):
            zeroed = value.clone()
            zeroed[:, kv, j] = 0
            change = ((o - layer_output(zeroed))[:, T - w:] ** 2).sum(-1) / (o[:, T - w:] ** 2).sum(-1)
            want[:, kv, j] = change.sum(-1)
    pol = LaProx(window=w)
    one = pol.step(_block(a.float(), v.float(), w_o.float(), kv_head), T).double()
    cut = 7                                          # the window (queries 5..8) split between two blocks
    parts = (pol.step(_block(a[:, :, :cut].float(), v.float(), w_o.float(), kv_head), T).double()
             + pol.step(_block(a[:, :, cut:].float(), v.float(), w_o.float(), kv_head, q_start=cut), T).double())
    for got in (one, parts):
        torch.testing.assert_close(got.reshape(B, Hkv, H // Hkv, T).sum(2), want, rtol=1e-5, atol=1e-7)


def _ctx(score, layer):
    score = torch.as_tensor(score, dtype=torch.float32).reshape(1, 1, -1)
    n = score.shape[-1]
    pos = torch.arange(n).expand(1, 1, n)
    return EvictionContext(pos=pos, valid=torch.ones_like(pos, dtype=torch.bool), score=score,
                           values=torch.ones(1, 1, n, 2), seen=n, budget=torch.full((1,), n), layer=layer,
                           num_heads=1)


def test_laprox_keeps_each_window_then_the_highest_scores_of_all_layers():
    """Two layers of one head and five entries, window 1, ratio 0.5: 5 of 10 kept; both windows
    (entry 4) first, then the three highest scores of both layers together: layer 1's .9 and .8,
    layer 0's .7 (layer 0's window score of 0 changes nothing)."""
    pol = get_policy("laprox")
    pol.params["window"] = 1
    cs = {0: _ctx([0.1, 0.7, 0.2, 0.3, 0.0], 0), 1: _ctx([0.05, 0.9, 0.8, 0.01, 0.02], 1)}
    b = pol.allocate(cs, 0.5)
    assert {l: k.tolist() for l, k in b.items()} == {0: [2], 1: [3]}
    kept = {l: sorted(kept_entries(pol, cs[l], b[l])[0][0, 0].tolist()) for l in cs}
    assert kept == {0: [1, 4], 1: [1, 2, 4]}
    assert pol.name == "laprox" and not pol.geometry and pol.prefill_only
