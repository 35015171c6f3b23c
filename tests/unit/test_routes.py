"""The fused routes (SPEC §10, :mod:`attngeom.capture.routes`) against the definitions.

Every quantity of :class:`~attngeom.capture.routes.FusedLayer` (one column, the diagonal, the
entropy from ``lse``, head outputs and shares, what each source receives through the attention's
backward ``PᵀF``, the source winner) is compared in float64 with a dense computation from the
attention map and :mod:`attngeom.metrics.formulas` (the block path's formulas): on random inputs with
grouped queries, padding, sliding windows, learned sinks and a value width other than the key's, and
on the q, k, v of tiny models of every family; then the summaries of the fused route against the
block path's, end to end."""

import pytest
import torch

from attngeom.capture import routes
from attngeom.metrics import formulas as F

TOL = dict(rtol=1e-10, atol=1e-10)
NAMES = ("attention", "value_weighted", "output_normalized", "contribution")


def _dense(q, k, v, scale, mask, sinks, G, G_full):
    """The attention map and every statistic from it, as the block path defines them (float64)."""
    B, H, T, _ = q.shape
    n_rep = H // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    seen = torch.ones(T, T, dtype=torch.bool).tril()[None, None] if mask is None else mask
    s = s.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    full = torch.softmax(s, dim=-1)
    a = full[..., :T]
    sink = None if sinks is None else full[..., T]
    u = a @ v
    uG, p = u @ G, F.pulled_back(u, G_full)
    hsq, osq = F.quad(u, G), F.output_sq_norm(u, p)
    ent = -torch.special.xlogy(full, full).sum(-1)
    return dict(a=a, v=v, k=k, sink=sink, u=u, uG=uG, p=p, hsq=hsq, osq=osq, entropy=ent,
                value_norm=F.projected_value_norm(v, G),
                contribution=F.contribution_from(a, uG, v, hsq),
                contribution_inter=F.contribution_inter_from(a, p, v, osq),
                head_share=F.head_share_from(u, p, osq))


def _random_case(seed, *, B=2, H=4, Hkv=2, T=13, dk=8, dv=8, lengths=None, window=None, sinks=False):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)   # noqa: E731
    q, k, v = rnd(B, H, T, dk), rnd(B, Hkv, T, dk), rnd(B, Hkv, T, dv)
    w_o = rnd(16, H * dv)
    lengths = torch.full((B,), T) if lengths is None else torch.tensor(lengths)
    mask = None
    if window is not None or (lengths < T).any():
        pos = torch.arange(T)
        m = pos[None, :] <= pos[:, None]
        if window is not None:
            m = m & (pos[None, :] > pos[:, None] - window)
        mask = (m[None] & (pos[None, None, :] < lengths[:, None, None]))[:, None]    # [B, 1, T, T]
    return dict(q=q, k=k, v=v, scale=0.37, mask=mask, lengths=lengths, G=F.gram(w_o, H), G_full=F.full_gram(w_o),
                sinks=rnd(H) if sinks else None)


def _check_layer(case, sink_col=0):
    q, k, v, mask, sinks = case["q"], case["k"], case["v"], case["mask"], case["sinks"]
    ref = _dense(q, k, v, case["scale"], mask, sinks, case["G"], case["G_full"])
    fused = routes.FusedLayer(q, k, v, case["scale"], mask, case["G"], case["G_full"], case["lengths"], sinks=sinks)
    valid = fused.query_valid[:, None, :].expand(ref["hsq"].shape)                  # [B, H, T]
    T = q.shape[2]

    def close(got, want, what):
        torch.testing.assert_close(got[valid], want[valid], **TOL, msg=what)

    close(fused.head_output.norm(dim=-1), ref["u"].norm(dim=-1), "head outputs")
    close(fused.attention_column(sink_col), ref["a"][..., sink_col], "sink column")
    close(fused.self_attention, torch.diagonal(ref["a"], dim1=-2, dim2=-1), "diagonal")
    close(fused.entropy, ref["entropy"], "entropy")
    close(fused.head_output_norm, ref["hsq"].sqrt(), "head output norms")
    close(fused.head_share, ref["head_share"], "head shares")
    close(fused.contribution_column(sink_col), ref["contribution"][..., sink_col], "sink contribution")
    close(fused.contribution_inter_column(sink_col), ref["contribution_inter"][..., sink_col], "inter")
    if sinks is not None:
        close(fused.learned_sink, ref["sink"], "learned sink")
    for norms in (ref["v"].norm(dim=-1), ref["value_norm"]):
        want = (ref["a"] * norms[:, :, None, :]).argmax(-1)
        assert torch.equal(fused.winner(norms)[valid], want[valid])
    w = fused.query_valid.double()
    got = fused.received(w, NAMES, value_norm=ref["value_norm"])
    want = F.received(ref["a"], w, NAMES, v=ref["v"], value_norm=ref["value_norm"],
                      head_out_norm=ref["hsq"].sqrt(), p=ref["p"], out_sq=ref["osq"])
    for n in NAMES:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=n)
    seen = (ref["a"].new_ones(T, T).tril()[None] if mask is None else mask[:, 0].double())
    torch.testing.assert_close(fused.seen_by(w), (w[:, None, :] @ seen.expand(w.shape[0], T, T)).squeeze(1), **TOL)


CASES = {
    "causal, grouped queries": dict(),
    "multi-query": dict(Hkv=1),
    "padded batch": dict(lengths=[13, 8]),
    "sliding window": dict(window=4),
    "window and padding": dict(window=5, lengths=[9, 13]),
    "learned sinks": dict(sinks=True, window=6),
    "value width other than the key's (MLA)": dict(dk=12, dv=6),
    "wide values": dict(dk=4, dv=10, lengths=[11, 13]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_fused_quantity_equals_the_definition_in_float64(name):
    _check_layer(_random_case(len(name), **CASES[name]))


def test_a_route_that_cannot_reproduce_the_attention_says_why():
    q, k = torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4)
    assert routes.unsupported(q, k, None, None) is None
    assert "soft-capping" in routes.unsupported(q, k, None, 50.0)
    assert "cached" in routes.unsupported(q[:, :, :1], k, None, None)
    assert "additive" in routes.unsupported(q, k, torch.zeros(1, 1, 5, 5), None)
    with pytest.raises(ValueError, match="auto, fused, block"):
        routes.check_route("fast")


def test_the_winner_reference_breaks_ties_to_the_earliest_source_and_honours_windows():
    q = torch.zeros(1, 1, 4, 2, dtype=torch.float64)          # every logit 0: a row is uniform
    k = torch.zeros(1, 1, 4, 2, dtype=torch.float64)
    n = torch.tensor([[[1.0, 2.0, 2.0, 1.0]]], dtype=torch.float64)
    idx, _ = routes.source_winner_reference(q, k, n, scale=1.0)
    assert idx.tolist() == [[[0, 1, 1, 1]]]
    idx, _ = routes.source_winner_reference(q, k, n, scale=1.0, window=2)
    assert idx.tolist() == [[[0, 1, 1, 2]]]
