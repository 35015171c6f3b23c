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
    B, H, Q, _ = a.shape
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


def _layer_block(a, value, w_o, kv_head, q_start=0, k_start=0, lengths=None, allowed=None):
    """A real :class:`~attngeom.capture.blocks.Block` of queries ``q_start ..`` and sources ``k_start ..``."""
    from attngeom.capture.blocks import Block, LayerState
    from attngeom.metrics import formulas as F

    B, H = a.shape[:2]
    T = value.shape[2]
    state = LayerState(layer=0, module=None, value=value, w_o=w_o, G=F.gram(w_o, H), G_full=F.full_gram(w_o),
                       kv_head=kv_head, lengths=torch.full((B,), T) if lengths is None else lengths)
    return Block(state=state, a=a[:, :, q_start:, k_start:].contiguous(), q_start=q_start, k_start=k_start,
                 allowed=None if allowed is None else allowed[None, None, q_start:, k_start:])


def test_laprox_on_real_blocks_with_a_window_padding_and_a_zero_output():
    """A real block whose sources start at 4 (a sliding window of 3): the scores equal the zeroing
    reference; padded queries are not read; a layer whose output is 0 scores 0, never NaN."""
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, T, d, D, w = 1, 4, 2, 10, 3, 6, 4
    kv_head = torch.arange(H) // (H // Hkv)
    value = torch.randn(B, Hkv, T, d, generator=g)
    w_o = torch.randn(D, H * d, generator=g)
    pos = torch.arange(T)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 3)
    a = torch.randn(B, H, T, T, generator=g).masked_fill(~allowed, float("-inf")).softmax(-1)

    def out(val):
        return torch.einsum("bhqd,Dhd->bqD", a @ val[:, kv_head], w_o.reshape(D, H, d))

    o = out(value)
    want = torch.zeros(B, Hkv, T)
    for kv in range(Hkv):
        for j in range(T):
            zeroed = value.clone()
            zeroed[:, kv, j] = 0
            want[:, kv, j] = (((o - out(zeroed))[:, T - w:] ** 2).sum(-1) / (o[:, T - w:] ** 2).sum(-1)).sum(-1)
    s = LaProx(window=w).step(_layer_block(a, value, w_o, kv_head, q_start=6, k_start=4, allowed=allowed), T)
    got = torch.zeros(B, H, T)
    got[..., 4:] = s
    torch.testing.assert_close(got.reshape(B, Hkv, 2, T).sum(2), want, rtol=1e-4, atol=1e-6)

    # right padding: a text of 7 real tokens in a batch padded to 10; of the window (queries 6..9)
    # only query 6 is real, so the score is its relative change alone, and padded sources score 0
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    a = torch.randn(B, H, T, T, generator=g).masked_fill(~causal, float("-inf")).softmax(-1)
    padded = LaProx(window=w).step(_layer_block(a, value, w_o, kv_head, lengths=torch.tensor([7])), T)
    o6 = out(value)[:, 6]
    want = torch.zeros(B, Hkv, T)
    for kv in range(Hkv):
        for j in range(T):
            zeroed = value.clone()
            zeroed[:, kv, j] = 0
            want[:, kv, j] = ((o6 - out(zeroed)[:, 6]) ** 2).sum(-1) / (o6**2).sum(-1)
    torch.testing.assert_close(padded.reshape(B, Hkv, 2, T).sum(2), want, rtol=1e-4, atol=1e-6)
    assert (padded[..., 7:] == 0).all()

    zero = LaProx(window=8).step(_layer_block(a, value, torch.zeros(D, H * d), kv_head), T)
    assert torch.isfinite(zero).all() and (zero == 0).all()
