"""The five metrics of SPEC §2 against a slow, obvious model-space computation, and their invariants."""

import math
import numpy as np
import pytest
import torch

from attngeom.metrics import formulas as M
from attngeom.traces.trace import analyze
from tiny_models import ARCHS, tiny_model

T = 16
SPEC_METRICS = ("attention", "value_weighted", "output_normalized", "contribution", "contribution_inter")
"""The five per-head maps of SPEC §2 (the registry's built-in entries)."""


def slow_metrics(a, v, w_o):
    """Model-space reference, one (query, source, head) at a time, with projected values
    ṽ_j^h = v_j^h W_O^h materialised. a [H,T,T], v [H,T,d], w_o [D, H*d] (float64)."""
    H, T_, _ = a.shape
    d = v.shape[-1]
    W = [w_o[:, h * d:(h + 1) * d].T for h in range(H)]          # W_O^h: [d, D]
    vt = [[v[h, j] @ W[h] for j in range(T_)] for h in range(H)]  # ṽ_j^h in R^D
    o_h = [[sum(a[h, i, j] * vt[h][j] for j in range(T_)) for i in range(T_)] for h in range(H)]
    o = [sum(o_h[h][i] for h in range(H)) for i in range(T_)]
    out = {k: np.zeros((H, T_, T_)) for k in SPEC_METRICS}
    out["relative_norm"] = np.zeros((H, T_, T_))
    out["cosine"] = np.zeros((H, T_, T_))
    for h in range(H):
        for i in range(T_):
            on = np.linalg.norm(o_h[h][i])
            for j in range(T_):
                vn = np.linalg.norm(vt[h][j])
                out["attention"][h, i, j] = a[h, i, j]
                out["value_weighted"][h, i, j] = a[h, i, j] * vn
                out["output_normalized"][h, i, j] = a[h, i, j] * vn / on
                out["contribution"][h, i, j] = o_h[h][i] @ (a[h, i, j] * vt[h][j]) / on**2
                out["contribution_inter"][h, i, j] = o[i] @ (a[h, i, j] * vt[h][j]) / (o[i] @ o[i])
                out["relative_norm"][h, i, j] = vn / on
                out["cosine"][h, i, j] = o_h[h][i] @ vt[h][j] / (on * vn)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_metrics_match_model_space_reference(arch):
    handle = tiny_model(arch)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, handle.model.config.vocab_size, (T,), generator=g)
    trace = analyze(handle, ids, block_elements=128)
    for lt in trace.layers:
        ref = slow_metrics(lt.a.double().numpy(), lt.v.double().numpy(), lt.w_o.double().numpy())
        for name in SPEC_METRICS:
            err = np.abs(lt.metric(name) - ref[name]).max()
            assert err < 1e-5, (arch, lt.index, name, err)
        f = lt.factors()
        for name in ("relative_norm", "cosine"):
            assert np.abs(f[name] - ref[name]).max() < 1e-4 * max(1, np.abs(ref[name]).max())
        assert np.abs(f["attention"] * f["relative_norm"] * f["cosine"] - lt.contribution).max() < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_contributions_sum_to_one(arch):
    handle = tiny_model(arch)
    trace = analyze(handle, handle.encode("the quick brown fox jumps over the lazy dog again and again"))
    for lt in trace.layers:
        assert np.abs(lt.contribution.sum(-1) - 1).max() < 1e-5
        assert np.abs(lt.contribution_inter.sum((0, 2)) - 1).max() < 1e-5
        assert np.abs(lt.head_share.sum(0) - 1).max() < 1e-5
        assert np.abs(lt.contribution_inter.sum(-1) - lt.head_share).max() < 1e-5
        assert np.abs(lt.attention.sum(-1) - 1).max() < 1e-5
        # token level: C_ij sums to one over sources
        assert np.abs(lt.token_score("contribution").sum(-1) - 1).max() < 1e-5


def test_output_normalized_ranks_differently_from_value_weighted():
    """SPEC §2: each head is normalised by its own output, so token-level orders can differ."""
    handle = tiny_model("llama")
    trace = analyze(handle, handle.encode("one two three four five six seven eight nine ten"))
    lt = trace.layers[0]
    vw = lt.token_score("value_weighted")
    on = lt.token_score("output_normalized")
    assert not np.array_equal(np.argsort(vw, -1), np.argsort(on, -1))


def _pieces(a, v, w_o):
    H = a.shape[1]
    G = M.gram(w_o, H)
    u = M.head_output(a, v)
    p = M.pulled_back(u, M.full_gram(w_o))
    return G, u, u @ G, p


def test_zero_output_gives_zero_weights_not_nan():
    a = torch.tensor([[[[0.5, 0.5]]]])
    v = torch.tensor([[[[1.0, 0.0], [-1.0, 0.0]]]])
    G, u, uG, p = _pieces(a, v, torch.eye(2))
    c = M.contribution_from(a, uG, v, M.quad(u, G))
    C = M.contribution_inter_from(a, p, v, M.output_sq_norm(u, p))
    for x in (c, C):
        assert torch.isfinite(x).all() and float(x.abs().max()) == 0.0


def test_hand_computed_contribution():
    """Two sources, one head, W_O = I: o = 0.5*(2,0) + 0.5*(0,1) = (1, 0.5)."""
    a = torch.tensor([[[[0.5, 0.5]]]])
    v = torch.tensor([[[[2.0, 0.0], [0.0, 1.0]]]])
    w_o = torch.eye(2)
    G, u, uG, p = _pieces(a, v, w_o)
    assert torch.allclose(M.layer_output(u, w_o), torch.tensor([[[1.0, 0.5]]]))
    # <o, a1 v1> = (1,0.5)·(1,0) = 1 ; <o, a2 v2> = (1,0.5)·(0,0.5) = 0.25 ; |o|^2 = 1.25
    c = M.contribution_from(a, uG, v, M.quad(u, G))[0, 0, 0]
    assert torch.allclose(c, torch.tensor([0.8, 0.2]))
    C = M.contribution_inter_from(a, p, v, M.output_sq_norm(u, p))[0, 0, 0]
    assert torch.allclose(C, torch.tensor([0.8, 0.2]))
    vw = M.value_weighted(a, M.projected_value_norm(v, G))[0, 0, 0]
    assert torch.allclose(vw, torch.tensor([1.0, 0.5]))
    on = M.output_normalized(a, M.projected_value_norm(v, G), M.quad(u, G).sqrt())[0, 0, 0]
    assert torch.allclose(on, torch.tensor([1.0, 0.5]) / 1.25**0.5)
    # the plain-piece forms agree with the piece-based ones
    o = M.layer_output(u, w_o)
    assert torch.allclose(M.contribution(a, u, v, G)[0, 0, 0], c)
    assert torch.allclose(M.contribution_inter(a, o, v, w_o)[0, 0, 0], C)


def test_two_heads_inter_contribution_by_hand():
    """Two heads with W_O^1 = [1 0], W_O^2 = [0 1] (D=2, d=1): o = (a·v¹, a·v²)."""
    a = torch.tensor([[[[1.0, 0.0]], [[0.25, 0.75]]]])         # [B=1, H=2, Q=1, S=2]
    v = torch.tensor([[[[3.0], [5.0]], [[4.0], [-4.0]]]])       # [1, 2, 2, 1]
    w_o = torch.eye(2)                                          # [D=2, H*d=2]
    G, u, uG, p = _pieces(a, v, w_o)
    # o = (1*3, 0.25*4 + 0.75*(-4)) = (3, -2); |o|^2 = 13
    C = M.contribution_inter_from(a, p, v, M.output_sq_norm(u, p))[0, :, 0]
    expected = torch.tensor([[9.0, 0.0], [-2.0 * 1.0, -2.0 * -3.0]]) / 13
    assert torch.allclose(C, expected)
    assert torch.allclose(M.head_share_from(u, p, M.output_sq_norm(u, p))[0, :, 0], torch.tensor([9.0, 4.0]) / 13)


def test_entropy_from_logits_equals_entropy_of_probabilities():
    """The block's entropy from the logits (no logarithm per element) equals -Σ a log a, with
    masked sources (additive minimum of the dtype, as eager masks) and peaked rows."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 7, 9, generator=g) * torch.tensor([0.1, 3.0, 30.0]).view(1, 3, 1, 1)
    mask = torch.zeros(7, 9).masked_fill(torch.arange(9)[None, :] > torch.arange(7)[:, None] + 2,
                                         torch.finfo(torch.float32).min)
    s = s + mask
    a = torch.softmax(s, -1)
    assert torch.allclose(M.entropy_from_logits(a, s), M.entropy(a), atol=1e-5)


def test_entropy_from_logits_reads_lse_at_a_reference_column():
    """``lse`` read at the larger of two candidate columns gives the entropy of the row-maximum form;
    a row whose candidates both hold (almost) nothing falls back to the row maxima, and the hand case
    ``a = (1/2, 1/4, 1/4)`` gives ``1.5 log 2``."""
    s = torch.log(torch.tensor([[2.0, 1.0, 1.0]])) + 5.0             # lse = 5 + log 4
    a = torch.softmax(s, -1)
    ref = torch.tensor([[1, 2]])                                    # both candidates hold 1/4
    assert torch.allclose(M.entropy_from_logits(a, s, ref), torch.tensor([1.5 * math.log(2.0)]), atol=1e-6)
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, 3, 7, 9, generator=g) * torch.tensor([0.1, 3.0, 30.0]).view(1, 3, 1, 1)
    s[0, 2, 0] = torch.tensor([-200.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])   # column 0 holds e^-200: none
    s[0, 2, 0, 3] = 50.0                                                            # and the mass sits on column 3
    a = torch.softmax(s, -1)
    ref = torch.tensor([0, 0]).view(1, 1, 1, 2).expand(2, 3, 7, 2)  # column 0 twice
    assert a[0, 2, 0, 0] < M.LSE_REFERENCE_MIN
    expected = M.entropy(a.double()).float()
    assert torch.allclose(M.entropy_from_logits(a, s, ref), expected, atol=1e-5)
    assert torch.allclose(M.entropy_from_logits(a, s, ref), M.entropy_from_logits(a, s), atol=2e-6)


@pytest.mark.parametrize("Q", [1, 5, 40])
def test_grouped_values_equal_values_repeated_per_head(Q):
    """Grouped-query attention: head outputs and received sums from the values one per key/value
    head (never repeated) equal those from the values repeated per query head, in both orders of
    the received-contribution sum (a decoding step, Q = 1, takes the per-group map ``X vᵀ``)."""
    g = torch.Generator().manual_seed(Q)
    B, Hkv, n_rep, S, d = 2, 3, 4, 40, 8
    H = Hkv * n_rep
    a = torch.softmax(torch.randn(B, H, Q, S, generator=g), -1)
    value = torch.randn(B, Hkv, S, d, generator=g)
    v = value.repeat_interleave(n_rep, dim=1)                     # [B, H, S, d], as repeat_kv lays it out
    assert torch.allclose(M.head_output(a, value), a @ v, atol=1e-6)
    p = torch.randn(B, H, Q, d, generator=g)
    w = torch.rand(B, Q, generator=g)
    out_sq = torch.rand(B, Q, generator=g) + 0.5
    grouped = M.received(a, w, ["contribution"], v=value, p=p, out_sq=out_sq)["contribution"]
    per_head = M.received(a, w, ["contribution"], v=v, p=p, out_sq=out_sq)["contribution"]
    ref = torch.einsum("bhqs,bhqs->bs", a, (p / out_sq[:, None, :, None] * w[:, None, :, None]) @ v.transpose(-1, -2))
    assert torch.allclose(grouped, ref, atol=1e-5) and torch.allclose(per_head, ref, atol=1e-5)


@pytest.mark.parametrize("n_rep", [1, 3])
def test_one_row_received_equals_received_with_the_weight_on_that_row(n_rep):
    """:func:`received_row` (a decoding step's answer-table row) is :func:`received` with the weight 1
    on one query and 0 elsewhere, for attention and contribution, grouped or not; a zero output
    gives no contribution."""
    g = torch.Generator().manual_seed(n_rep)
    Hg, Q, S, d = 3, 5, 17, 4
    H = Hg * n_rep
    a = torch.softmax(torch.randn(1, H, Q, S, generator=g), -1)
    v = torch.randn(1, Hg, S, d, generator=g)
    p = torch.randn(1, H, Q, d, generator=g)
    out_sq = torch.rand(1, Q, generator=g) + 0.5
    out_sq[0, 4] = 0.0
    for r in range(Q):
        w = torch.zeros(1, Q)
        w[0, r] = 1.0
        want = M.received(a, w, ["attention", "contribution"], v=v, p=p, out_sq=out_sq)
        got = M.received_row(a[0, :, r], p[0, :, r], out_sq[0, r], v[0])
        assert torch.allclose(got[0], want["attention"][0], atol=1e-6)
        assert torch.allclose(got[1], want["contribution"][0], atol=1e-6)
    assert torch.equal(M.received_row(a[0, :, 4], p[0, :, 4], out_sq[0, 4], v[0])[1], torch.zeros(S))
    # by hand: one head, two sources, p = (1, 0), ‖o‖² = 2: C_j = a_j (p·v_j) / 2
    row = M.received_row(torch.tensor([[0.25, 0.75]]), torch.tensor([[1.0, 0.0]]), torch.tensor(2.0),
                         torch.tensor([[[2.0, 5.0], [-1.0, 3.0]]]))
    assert torch.allclose(row, torch.tensor([[0.25, 0.75], [0.25, -0.375]]))
