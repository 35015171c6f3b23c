"""AnDPro (Geng et al., NeurIPS 2025) as its authors' code scores and keeps entries: scores by
hand on a six-token head, the ranking and the layer's one cut by hand, and a tiny model's prefill
against a literal transcription of the code's loop (github.com/MIRALab-USTC/LLM-AnDPro,
``AnDProAdaptiveSnapKVCluster.update_kv_wo_gqa``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import eager_attentions, tiny_model

from attngeom.kvcache import prefill as P
from attngeom.kvcache.cache import kept_entries
from attngeom.kvcache.policies import AnDPro, EvictionContext, get_policy

# one head, six tokens, d = 2; the last two queries (4 and 5) are the observation window
V = torch.tensor([[1.0, 0], [0, 1], [1, 1], [2, 0], [0, 0], [1, -1]])
ROWS = torch.tensor([[0.1, 0.2, 0.3, 0.2, 0.2, 0.0],       # query 4 (entry 5 is its future: 0)
                     [0.2, 0.1, 0.1, 0.2, 0.2, 0.2]])      # query 5


class _State:
    def __init__(self, v):
        self.v = v

    @property
    def num_sources(self):
        return self.v.shape[2]

    def v_from(self, start):
        return self.v[:, :, start:]


def _block(q_start, rows, v=V):
    """A captured block of one head: queries ``q_start ..``, sources from 0 up to its last query."""
    S = q_start + rows.shape[0]
    return SimpleNamespace(a=rows[:, :S].reshape(1, 1, rows.shape[0], S), q_start=q_start, k_start=0,
                           state=_State(v.reshape(1, 1, *v.shape)))


def test_andpro_scores_by_hand():
    """s_j = Σ_i a'_ij ⟨v_j, o_i^E⟩ with o_i^E = Σ_{j∈E} a'_ij v_j, E = entries 1..3 (not the first
    chunk 0, not the window 4, 5: chunk 1, window 2)."""
    whole = torch.cat([torch.full((4, 6), 0.1), ROWS])                      # queries 0..3 are not read
    # kernel 1 (no pooling): o_4 = .2(0,1)+.3(1,1)+.2(2,0) = (.7,.5); o_5 = .1(0,1)+.1(1,1)+.2(2,0) = (.5,.2)
    # s_0 = .1·.7 + .2·.5 = .17; s_1 = .2·.5 + .1·.2 = .12; s_2 = .3·1.2 + .1·.7 = .43
    # s_3 = .2·1.4 + .2·1.0 = .48; s_4 = 0 (v_4 = 0); s_5 = 0·.2 + .2·.3 = .06
    s = AnDPro(window=2, kernel=1, chunk=1).step(_block(0, whole), 6)
    assert torch.allclose(s, torch.tensor([[[0.17, 0.12, 0.43, 0.48, 0.0, 0.06]]]))
    # kernel 3 (max over each entry and its two neighbours): a'_4 = (.2,.3,.3,.3,.2,.2), a'_5 = .2 everywhere
    # (entry 5, query 4's future, gets .2 from its neighbour, as the code's pooling of the masked row gives);
    # o_4 = .3((0,1)+(1,1)+(2,0)) = (.9,.6); o_5 = .2(3,2) = (.6,.4)
    # s_0 = .2·.9 + .2·.6 = .30; s_1 = .3·.6 + .2·.4 = .26; s_2 = .3·1.5 + .2·1.0 = .65
    # s_3 = .3·1.8 + .2·1.2 = .78; s_4 = 0; s_5 = .2·.3 + .2·.2 = .10
    pol = AnDPro(window=2, kernel=3, chunk=1)
    s = pol.step(_block(0, whole), 6)
    assert torch.allclose(s, torch.tensor([[[0.30, 0.26, 0.65, 0.78, 0.0, 0.10]]]))
    # the window split between two blocks (query 4 sees sources 0..4 only): the same sum
    parts = pol.step(_block(4, ROWS[:1]), 6) + pol.step(_block(5, ROWS[1:]), 6)
    assert torch.allclose(parts, s)
    assert pol.step(_block(0, whole[:4]), 6) is None                        # a block before the window


def test_andpro_anchor_leaves_out_the_first_chunk_and_the_padded_window():
    """Chunk 2, window 2, six tokens: E = entries 2, 3 (chunk 0 and the last chunk kept), so
    o_4 = .3(1,1)+.2(2,0) = (.7,.3), o_5 = .1(1,1)+.2(2,0) = (.5,.1). Five tokens (padded to six at
    the end, as the code pads): the window's last chunk is entry 4 alone, E = entries 2, 3."""
    whole = torch.cat([torch.full((4, 6), 0.1), ROWS])
    s = AnDPro(window=2, kernel=1, chunk=2).step(_block(0, whole), 6)
    # s_0 = .1·.7 + .2·.5 = .17; s_1 = .2·.3 + .1·.1 = .07; s_2 = .3·1.0 + .1·.6 = .36
    # s_3 = .2·1.4 + .2·1.0 = .48; s_4 = 0; s_5 = 0·.4 + .2·.4 = .08
    assert torch.allclose(s, torch.tensor([[[0.17, 0.07, 0.36, 0.48, 0.0, 0.08]]]))
    # five tokens: queries 3 and 4 are the window; a_3 = (.5,0,.5,0,0), a_4 = ROWS[0][:5]
    rows = torch.tensor([[0.5, 0.0, 0.5, 0.0, 0.0, 0.0], ROWS[0].tolist()])
    s = AnDPro(window=2, kernel=1, chunk=2).step(_block(3, rows, V[:5]), 5)
    # o_3 = .5(1,1) = (.5,.5); o_4 = .3(1,1)+.2(2,0) = (.7,.3)
    # s_0 = .5·.5 + .1·.7 = .32; s_1 = 0 + .2·.3 = .06; s_2 = .5·1.0 + .3·1.0 = .80
    # s_3 = 0·1.0 + .2·1.4 = .28; s_4 = 0
    assert torch.allclose(s, torch.tensor([[[0.32, 0.06, 0.80, 0.28, 0.0]]]))


def _ctx(score, n_kv=2):
    score = torch.as_tensor(score, dtype=torch.float32).reshape(1, n_kv, -1)
    n = score.shape[-1]
    pos = torch.arange(n).expand(1, n_kv, n)
    return EvictionContext(pos=pos, valid=torch.ones_like(pos, dtype=torch.bool), score=score,
                           values=torch.ones(1, n_kv, n, 2), seen=n, budget=torch.full((n_kv,), n), layer=0,
                           num_heads=n_kv)


def _kept(policy, ctx, keep):
    idx, ok = kept_entries(policy, ctx, keep)
    return [sorted(int(p) for p, o in zip(idx[0, h], ok[0, h]) if o) for h in range(idx.shape[1])]


def test_andpro_keeps_the_first_chunk_the_window_then_the_best_chunks_of_the_layer():
    pol = AnDPro(window=2, kernel=1, chunk=2)
    # 2 heads x 8 entries, ratio 0.25: 6 per head, 12 in the layer; each head's chunk 0 (entries 0, 1)
    # and window (6, 7) first: 8; the 4 others go to the highest chunk sums of both heads:
    # head 1's chunk (2,3) = 7 and chunk (4,5) = 6.8 (its entry 5 scores 0 but rides with 4),
    # before head 0's chunks (2,3) = 1 and (4,5) = 0.5 (head 0's high sink and window scores change nothing)
    score = [[9, 9, 0.6, 0.4, 0.5, 0, 9, 9], [0, 0, 3.5, 3.5, 6.8, 0, 0, 0]]
    cs = {0: _ctx(score)}
    b = pol.allocate(cs, 0.25)
    assert b[0].tolist() == [4, 8]
    assert _kept(pol, cs[0], b[0]) == [[0, 1, 6, 7], list(range(8))]
    # head 0's chunk (4,5) raised to 8: it takes two of the four places, head 1 keeps its chunk (2,3)
    score[0][4] = 8.0
    cs = {0: _ctx(score)}
    b = pol.allocate(cs, 0.25)
    assert b[0].tolist() == [6, 6]
    assert _kept(pol, cs[0], b[0]) == [[0, 1, 4, 5, 6, 7], [0, 1, 2, 3, 6, 7]]
    # seven entries (the code pads to eight at the end): the window is the last chunk, entry 6 alone
    tier, chunk_score = pol.priority(_ctx([[1, 1, 2, 3, 4, 5, 6]], n_kv=1))
    assert tier[0, 0].tolist() == [1, 1, 0, 0, 0, 0, 1]
    assert chunk_score[0, 0].tolist() == [2, 2, 5, 5, 9, 9, 6]


def test_andpro_arguments_are_checked():
    with pytest.raises(ValueError):
        AnDPro(window=6, chunk=4)
    with pytest.raises(ValueError):
        AnDPro(kernel=4)


def _authors_chunk_scores(A, V, window, kernel, chunk):
    """The code's loop, transcribed: ``A [H, T, T]`` one layer's attention, ``V [H, T, d]`` its values
    per query head; the projection of every chunk of every head, before the protected chunks are set aside."""
    F = torch.nn.functional
    H, T, _ = A.shape
    rows = F.max_pool1d(A[:, T - window:, :], kernel, stride=1, padding=kernel // 2)     # [H, w, T]
    pad = (chunk - T % chunk) % chunk
    rows, Vp = F.pad(rows, (0, pad)), F.pad(V, (0, 0, 0, pad))
    n_chunks = (T + pad) // chunk
    drop = torch.ones(H, n_chunks, dtype=torch.bool)
    drop[:, 0] = False
    drop[:, -(window // chunk):] = False
    out = torch.zeros(H, n_chunks)
    for i in range(window):
        per_chunk = (Vp * rows[:, i, :, None]).view(H, n_chunks, chunk, -1).sum(2)      # [H, chunks, d]
        dropped = (per_chunk * drop[..., None]).sum(1)                                 # the anchor
        out += (per_chunk * dropped[:, None]).sum(-1)
    return out


def test_andpro_prefill_scores_are_the_authors_chunk_projections(monkeypatch):
    """A tiny GQA model's prefill (70 tokens: padded by 2 to whole chunks), read in blocks of 5
    queries: every query head's chunk sums of the recorded scores equal the code's loop on the
    eager attention; the selection keeps each head's first chunk and window and the layer's total."""
    from attngeom.capture import kernel

    monkeypatch.setattr(kernel, "query_blocks", lambda B, H, Tq, S, budget, min_queries=1:
                        [(i, min(Tq, i + 5)) for i in range(0, Tq, 5)])
    h = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 128, (70,), generator=g).tolist()
    pol = get_policy("andpro")
    w, kern, c = pol.params["window"], pol.params["kernel"], pol.params["chunk"]
    pre = P.prefill(h, ids, [pol])
    att = eager_attentions(h, ids)
    r = h.num_heads // h.num_kv_heads
    for l in range(len(att)):
        values = pre.cache.layers[l].values[0].float().repeat_interleave(r, dim=0)      # [H, T, d]
        want = _authors_chunk_scores(att[l][0].float(), values, w, kern, c)
        got = torch.nn.functional.pad(pre.scores["andpro"][l][0], (0, 2)).view(h.num_heads, -1, c).sum(-1)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), (l, (got - want).abs().max())
    sel = P.selection_at_ratio(pre, pol, 0.5, h.num_heads)
    assert sel.kept() == len(att) * h.num_kv_heads * (70 - 35)
    for l, idx in sel.idx.items():
        for g_ in range(h.num_kv_heads):
            kept = set(idx[0, g_][sel.ok[l][0, g_]].tolist())
            assert set(range(c)) | set(range(70 - (w - 2), 70)) <= kept
