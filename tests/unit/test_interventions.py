"""Intervention engine (SPEC §3): invariants on every architecture, and the ranking on constructed blocks."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
from transformers import AttentionInterface

from attngeom.capture import session as capture
from attngeom.capture.blocks import Block, LayerState
from attngeom.capture.session import Session
from attngeom.errors import InputError
from attngeom.capture.interventions import RankIntervention, SourceMask, Variant, masked_count, random_scores, select_mask
from attngeom.streaming.reducers import InputBatch
from attngeom.streaming import forward, make_batches
from tiny_models import ARCHS, tiny_model

IDS = [1] + list(range(10, 34))  # BOS + 24 tokens: longer than the sliding windows (8) of the tiny models
T = len(IDS)


def _batch(handle, rows: int = 1) -> InputBatch:
    return next(make_batches(handle, [IDS] * rows, rows))


def _o_proj_inputs(handle):
    """Register pre-hooks on every attention layer's o_proj; returns (store, remove)."""
    store: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(handle.model.model.layers):
        attn = layer.self_attn

        def hook(mod, args, i=i):
            store[i] = args[0].detach().clone()
        hooks.append(attn.o_proj.register_forward_pre_hook(hook))
    return store, lambda: [h.remove() for h in hooks]


@contextlib.contextmanager
def _spy_attention(records: dict):
    """Record q, k, v, mask, scaling, softcap handed to the attention function, per layer."""
    original = capture.attngeom_attention

    def spy(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kw):
        records[int(module.layer_idx)] = dict(q=query.detach().clone(), k=key.detach().clone(),
                                              v=value.detach().clone(), mask=attention_mask,
                                              scaling=scaling if scaling is not None else module.head_dim ** -0.5,
                                              softcap=softcap, sinks=getattr(module, "sinks", None))
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        softcap=softcap, **kw)

    AttentionInterface.register(capture.ATTN_NAME, spy)
    try:
        yield records
    finally:
        AttentionInterface.register(capture.ATTN_NAME, original)


def _reference_output(rec: dict, masked: torch.Tensor) -> torch.Tensor:
    """Slow reference of one layer's attention output (o_proj input) with ``masked [T, T]`` sources
    removed, from the recorded q, k, v, in float64: ``[B, T, H*d]``."""
    q, k, v = rec["q"].double(), rec["k"].double(), rec["v"].double()
    B, H, Tq, d = q.shape
    rep = H // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    out = torch.zeros(B, Tq, H * v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                logits = []
                for j in range(k.shape[2]):
                    s = float(q[b, h, i] @ k[b, h, j]) * rec["scaling"]
                    if rec["softcap"] is not None:
                        s = math.tanh(s / rec["softcap"]) * rec["softcap"]
                    mask = rec["mask"]
                    if mask is None:
                        ok = j <= i
                    elif mask.dtype == torch.bool:
                        ok = bool(mask[b if mask.shape[0] > 1 else 0, 0, i, j])
                    else:
                        ok = float(mask[b if mask.shape[0] > 1 else 0, 0, i, j]) > -1e30
                    logits.append(s if ok else -math.inf)
                m = max(logits)
                e = [math.exp(x - m) if x != -math.inf else 0.0 for x in logits]
                z = sum(e)
                acc = torch.zeros(v.shape[-1], dtype=torch.float64)
                for j, ej in enumerate(e):
                    if ej and not masked[i, j]:
                        acc += (ej / z) * v[b, h, j]
                out[b, i, h * v.shape[-1]:(h + 1) * v.shape[-1]] = acc
    return out


# --------------------------------------------------------------------------------------------
# Invariants on every architecture
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_ratio_zero_leaves_logits_unchanged(arch):
    h = tiny_model(arch)
    batch = _batch(h, rows=3)
    with torch.no_grad():
        plain = h.model(input_ids=batch.ids, use_cache=False).logits.float()
    observed = forward(h, batch, Session(), logits=True)
    variants = [Variant("contribution", "comprehensiveness", 0.0), Variant("attention", "sufficiency", 0.0),
                Variant("random", "comprehensiveness", 0.0, per_head=True)]
    zero = forward(h, batch, Session(intervention=RankIntervention(variants)), logits=True)
    assert torch.equal(zero, observed)
    torch.testing.assert_close(zero, plain, rtol=1e-5, atol=1e-5)
    # and a real ratio does change them (the intervention is live on this architecture)
    some = forward(h, batch, Session(intervention=RankIntervention(Variant("attention", "comprehensiveness", 0.5))),
                   logits=True)
    assert (some - plain).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["comprehensiveness", "sufficiency"])
def test_masking_every_source_zeroes_the_attention_output(arch, mode):
    h = tiny_model(arch)
    layer = 1
    batch = _batch(h, rows=1)
    store, remove = _o_proj_inputs(h)
    try:
        forward(h, batch, Session(intervention=RankIntervention(Variant("value_weighted", mode, 1.0)),
                                  layers=[layer]), logits=True)
    finally:
        remove()
    assert store[layer].abs().max() == 0.0
    assert store[0].abs().max() > 0.0  # the layer before is untouched


@pytest.mark.parametrize("arch", ARCHS)
def test_hand_built_mask_equals_slow_reference(arch):
    h = tiny_model(arch)
    layer = h.num_layers - 1 if arch == "gemma2" else 1  # gemma2: layer 1 is full attention
    g = torch.Generator().manual_seed(7)
    masked = (torch.rand(T, T, generator=g) < 0.4) & torch.ones(T, T, dtype=torch.bool).tril()
    masked[:, 0] |= torch.rand(T, generator=g) < 0.5  # the sink too, sometimes
    batch = _batch(h, rows=1)
    records: dict = {}
    store, remove = _o_proj_inputs(h)
    try:
        with _spy_attention(records):
            forward(h, batch, Session(intervention=SourceMask(masked), layers=[layer]), logits=True)
    finally:
        remove()
    ref = _reference_output(records[layer], masked)
    torch.testing.assert_close(store[layer].double(), ref, rtol=1e-4, atol=1e-5)
    # every layer of a sliding-window model: layer 0 too (sliding for mistral/gemma2/gemma3)
    records = {}
    store, remove = _o_proj_inputs(h)
    try:
        with _spy_attention(records):
            forward(h, batch, Session(intervention=SourceMask(masked), layers=[0]), logits=True)
    finally:
        remove()
    torch.testing.assert_close(store[0].double(), _reference_output(records[0], masked), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# The ranking on constructed blocks
# --------------------------------------------------------------------------------------------


def _block(a: torch.Tensor, allowed=None, q_start: int = 0, k_start: int = 0) -> Block:
    B, H, Q, S = a.shape
    d, D = 2, H * 2
    kw = dict(layer=0, module=None, value=torch.zeros(B, H, k_start + S, d), w_o=torch.eye(D),
              G=torch.eye(d).expand(H, d, d), kv_head=torch.arange(H),
              lengths=torch.full((B,), max(q_start + Q, k_start + S)))
    if "G_full" in {f.name for f in dataclasses.fields(LayerState)}:
        kw["G_full"] = torch.eye(D)
    state = LayerState(**kw)
    return Block(state=state, a=a, q_start=q_start, k_start=k_start, allowed=allowed)


def _causal_scores(n: int, seed: int = 0, heads: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(1, heads, n, n, generator=g) * torch.ones(n, n).tril()
    return a


def _expected(scores, i, k, top):
    """Brute-force selection: order 'higher first, earlier position first on ties'."""
    order = sorted(range(i + 1), key=lambda j: (-float(scores[j]), j))
    return set(order[:k]) if top else set(order[len(order) - k:])


@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5, 0.9])
def test_comprehensiveness_masks_top_k_and_sufficiency_bottom_k(ratio):
    n = 12
    a = _causal_scores(n)
    blk = _block(a)
    for mode, top in (("comprehensiveness", True), ("sufficiency", False)):
        m = RankIntervention(Variant("attention", mode, ratio)).mask(blk)[0, 0]
        for i in range(n):
            k = math.floor(ratio * (i + 1) + 1e-9)
            got = set(torch.nonzero(m[i]).flatten().tolist())
            assert got == _expected(a[0, 0, i], i, k, top), (mode, i)
    # and the edited weights are the attention with exactly those entries zeroed
    edited = RankIntervention(Variant("attention", "comprehensiveness", ratio))(blk)
    m = RankIntervention(Variant("attention", "comprehensiveness", ratio)).mask(blk)
    assert torch.equal(edited, a.masked_fill(m, 0.0))


def test_masked_count_is_floor_of_r_times_i_plus_one():
    pos = torch.arange(200)
    k = masked_count(0.29, pos)[0]
    assert k[99] == 29  # 0.29 * 100 is 28.999999999999996 in floating point
    assert all(int(k[i]) == math.floor(round(0.29 * (i + 1), 9)) for i in range(200))
    assert masked_count([0.0, 1.0], pos)[1].tolist() == (pos + 1).tolist()


def test_ties_go_to_the_earlier_position_and_top_bottom_partition():
    a = torch.full((1, 1, 6, 6), 0.0)
    a[0, 0] = torch.tensor([1.0, 0, 0, 0, 0, 0]).expand(6, 6) * 0 + 1.0 / 6  # all equal
    a = a * torch.ones(6, 6).tril()
    blk = _block(a)
    top = RankIntervention(Variant("attention", "comprehensiveness", 0.5)).mask(blk)[0, 0]
    assert torch.nonzero(top[5]).flatten().tolist() == [0, 1, 2]
    bottom = RankIntervention(Variant("attention", "sufficiency", 0.5)).mask(blk)[0, 0]
    assert torch.nonzero(bottom[5]).flatten().tolist() == [3, 4, 5]
    # top-k and bottom-(n-k) partition the visible sources (random scores, no ties)
    a = _causal_scores(10, seed=3)
    blk = _block(a)
    t = RankIntervention(Variant("attention", "comprehensiveness", 0.3)).mask(blk)[0, 0]
    vis = torch.ones(10, 10, dtype=torch.bool).tril()
    for i in range(10):
        k = math.floor(0.3 * (i + 1) + 1e-9)
        sel = select_mask(a[0, :, i:i + 1], vis[None, i:i + 1], torch.tensor([[i + 1 - k]]), torch.tensor([False]))
        assert torch.equal(sel[0, 0] | t[i], vis[i]) and not (sel[0, 0] & t[i]).any()


def test_signed_and_absolute_ranking():
    # contribution-like signed scores: a large negative score is last when signed, first when absolute
    n = 5
    blk = _block(torch.ones(1, 1, n, n).tril() / 5)
    scores = torch.tensor([[0.5, -2.0, 0.2, 0.1, 0.3]]).expand(n, n)[None]
    vis = torch.ones(n, n, dtype=torch.bool).tril()[None]
    k = torch.full((1, n), 1)
    signed = select_mask(scores, vis, k, torch.tensor([True]))
    absolute = select_mask(scores.abs(), vis, k, torch.tensor([True]))
    assert signed[0, 4].nonzero().flatten().tolist() == [0]
    assert absolute[0, 4].nonzero().flatten().tolist() == [1]
    inter = RankIntervention(Variant("attention", "comprehensiveness", 0.2, absolute=True))
    assert inter.scores(blk, inter.variants[0], torch.tensor([0])).min() >= 0


def test_per_head_ranking_uses_each_heads_map():
    a = _causal_scores(8, seed=1, heads=3)
    blk = _block(a)
    m = RankIntervention(Variant("attention", "comprehensiveness", 0.4, per_head=True)).mask(blk)
    assert m.shape == (1, 3, 8, 8)
    for h in range(3):
        for i in range(8):
            k = math.floor(0.4 * (i + 1) + 1e-9)
            assert set(m[0, h, i].nonzero().flatten().tolist()) == _expected(a[0, h, i], i, k, True)
    tok = RankIntervention(Variant("attention", "comprehensiveness", 0.4)).mask(blk)
    assert tok.shape[1] == 1
    mean = a.mean(1)[0]
    for i in range(8):
        k = math.floor(0.4 * (i + 1) + 1e-9)
        assert set(tok[0, 0, i].nonzero().flatten().tolist()) == _expected(mean[i], i, k, True)


def test_sliding_window_ranks_among_visible_sources_only():
    n, w = 12, 4
    qi = torch.arange(n)[:, None]
    kj = torch.arange(n)[None, :]
    allowed = ((kj <= qi) & (kj > qi - w))[None, None]
    a = _causal_scores(n, seed=5) * allowed
    blk = _block(a, allowed=allowed)
    for mode in ("comprehensiveness", "sufficiency"):
        m = RankIntervention(Variant("attention", mode, 0.5)).mask(blk)[0, 0]
        for i in range(n):
            k = min(math.floor(0.5 * (i + 1) + 1e-9), min(i + 1, w))
            got = m[i].nonzero().flatten().tolist()
            assert len(got) == k and all(allowed[0, 0, i, j] for j in got)
            vis = [j for j in range(n) if allowed[0, 0, i, j]]
            order = sorted(vis, key=lambda j: (-float(a[0, 0, i, j]), j))
            assert set(got) == set(order[:k] if mode == "comprehensiveness" else order[len(order) - k:])


def test_block_offsets_use_absolute_positions():
    # a block of queries 6..9 with sources 2..9 (as under a sliding window): k_i uses i, not the index
    n = 10
    full = _causal_scores(n, seed=9)
    qi = torch.arange(6, 10)[:, None]
    kj = torch.arange(2, 10)[None, :]
    allowed = (kj <= qi)[None, None]
    sub = full[:, :, 6:10, 2:10] * allowed
    blk = _block(sub, allowed=allowed, q_start=6, k_start=2)
    m = RankIntervention(Variant("attention", "comprehensiveness", 0.3)).mask(blk)[0, 0]
    for r, i in enumerate(range(6, 10)):
        k = math.floor(0.3 * (i + 1) + 1e-9)
        got = {j + 2 for j in m[r].nonzero().flatten().tolist()}
        order = sorted(range(2, i + 1), key=lambda j: (-float(full[0, 0, i, j]), j))
        assert got == set(order[:k])


# --------------------------------------------------------------------------------------------
# Random ranking, batching, bad input
# --------------------------------------------------------------------------------------------


def test_random_ranking_is_seeded_and_reproducible():
    q, k = torch.arange(3, 9), torch.arange(0, 9)
    a = random_scores(1, torch.tensor([0, 5]), 2, q, k)
    b = random_scores(1, torch.tensor([0, 5]), 2, q, k)
    assert torch.equal(a, b) and a.shape == (2, 6, 9)
    assert not torch.equal(random_scores(2, torch.tensor([0, 5]), 2, q, k), a)   # other seed
    assert not torch.equal(a[0], a[1])                                           # other salt
    assert not torch.equal(random_scores(1, torch.tensor([0]), 3, q, k)[0], a[0])  # other layer
    # independent of how the queries are split into blocks
    whole = random_scores(1, torch.tensor([0]), 2, torch.arange(0, 9), k)
    assert torch.equal(whole[:, 3:9], a[:1])
    assert 0.0 <= float(a.min()) and float(a.max()) < 1.0
    assert random_scores(0, torch.tensor([0]), 0, q, k, heads=3).shape == (1, 3, 6, 9)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_random_intervention_reproducible_across_runs_and_block_sizes(arch):
    h = tiny_model(arch)
    batch = _batch(h)
    v = Variant("random", "sufficiency", 0.5, seed=3)
    one = forward(h, batch, Session(intervention=RankIntervention(v, salts=[4])), logits=True)
    two = forward(h, batch, Session(intervention=RankIntervention(v, salts=[4]), block_elements=64), logits=True)
    torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-5)
    other = forward(h, batch, Session(intervention=RankIntervention(Variant("random", "sufficiency", 0.5, seed=4),
                                                                     salts=[4])), logits=True)
    assert (other - one).abs().max() > 1e-4


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_batched_variants_equal_one_at_a_time(arch):
    h = tiny_model(arch)
    variants = [Variant(None), Variant("contribution", "comprehensiveness", 0.3),
                Variant("output_normalized", "sufficiency", 0.6), Variant("random", "comprehensiveness", 0.4, seed=1),
                Variant("contribution", "sufficiency", 0.3, per_head=True)]
    batched = forward(h, _batch(h, rows=len(variants)),
                      Session(intervention=RankIntervention(variants, salts=[2] * len(variants))), logits=True)
    for b, v in enumerate(variants):
        alone = forward(h, _batch(h), Session(intervention=RankIntervention(v, salts=[2])), logits=True)
        torch.testing.assert_close(batched[b], alone[0], rtol=1e-4, atol=1e-4)


def test_bad_variants_are_refused():
    with pytest.raises(InputError, match="unknown metric 'nope'"):
        Variant("nope", "comprehensiveness", 0.5)
    with pytest.raises(InputError, match="unknown mode"):
        Variant("attention", "both", 0.5)
    with pytest.raises(InputError, match=r"ratio must be in \[0, 1\]"):
        Variant("attention", "sufficiency", 1.5)
    with pytest.raises(ValueError, match="variants for a batch"):
        blk = _block(_causal_scores(4))
        RankIntervention([Variant("attention", ratio=0.5)] * 2)(blk)


def _rank_reference(scores, visible, k, top):
    """The ranking by a stable sort (the previous implementation, kept as the reference): ranks in
    "higher score first, earlier position first" order among the visible sources."""
    vis = visible.expand_as(scores)
    s = scores.float().masked_fill(~vis, float("-inf"))
    s = torch.where(torch.isnan(s), float("-inf"), s)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(s.shape[-1]).expand_as(order))
    # hidden sources tie with visible -inf/NaN scores in the sort: rank the visible ones first
    ranks = torch.where(vis, ranks, ranks + s.shape[-1])
    ranks = torch.empty_like(order).scatter_(-1, ranks.argsort(dim=-1, stable=True), torch.arange(s.shape[-1]).expand_as(order))
    n = vis.sum(-1)
    extra = scores.dim() - 3
    kk = torch.minimum(k.view(k.shape[0], *([1] * extra), k.shape[1]), n)
    tp = top.view(-1, *([1] * (scores.dim() - 1)))
    first = ranks < kk.unsqueeze(-1)
    last = (ranks >= (n - kk).unsqueeze(-1)) & (ranks < n.unsqueeze(-1))
    return torch.where(tp, first, last) & vis


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("per_head", [False, True])
def test_select_mask_equals_a_stable_sort_reference(seed, per_head):
    """Heavy ties, ±0.0, ±inf and NaN, causal and sliding-window visibility, k from 0 past n, both
    modes in one call: the partial-sort selection equals the stable-sort ranking exactly."""
    g = torch.Generator().manual_seed(seed)
    R, H, Q, S = 5, 3, 7, 40
    shape = (R, H, Q, S) if per_head else (R, Q, S)
    scores = torch.randint(-3, 4, shape, generator=g).float() * 0.5            # many exact ties
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    pick = torch.rand(shape, generator=g) < 0.1
    scores = torch.where(pick, special[torch.randint(0, 5, shape, generator=g)], scores)
    if seed % 2:
        scores = scores + torch.rand(shape, generator=g)                        # mostly distinct
    q = torch.arange(S - Q, S)[:, None]
    j = torch.arange(S)[None, :]
    window = 12 if seed % 3 == 0 else S
    vis = ((j <= q) & (j > q - window))[None, None]
    if not per_head:
        vis = vis[:, 0]
    k = torch.randint(0, S + 5, (R, Q), generator=g)
    top = torch.rand(R, generator=g) < 0.5
    got = select_mask(scores, vis, k, top)
    assert torch.equal(got, _rank_reference(scores, vis, k, top))
    # ratio-like counts (every query masks about the same share), where the complement is chosen
    for r in (0.1, 0.5, 0.9):
        kr = torch.floor(r * (vis.expand(shape).sum(-1).reshape(R, -1, Q)[:, 0].float() + 1e-9)).long()
        assert torch.equal(select_mask(scores, vis, kr, top), _rank_reference(scores, vis, kr, top))
