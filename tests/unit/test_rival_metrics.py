"""The value-aware measures of the faithfulness head-to-head (SPEC §2.1), each against a slow direct
computation on a tiny model: leave-one-out against dropping the source and renormalising the row,
value zeroing against zeroing the values and rerunning the layer, ALTI against its decomposition
formed term by term in model space, gradient-weighted attention against autograd through
transformers' eager attention (and a finite difference of the intervened forward), rollouts against
their composition formed from eager maps; and hand-computed cases."""

import pytest
import torch

from attngeom.capture.interventions import Variant
from attngeom.capture.blocks import Block, LayerState
from attngeom.errors import InputError
from attngeom.metrics import formulas as M
from attngeom.metrics import registry as R
from attngeom.traces.trace import analyze
from tiny_models import eager_attentions, tiny_model

TEXT = "the cat sat on the mat while the dog slept"


def _hand_block(a, v, sink=None):
    """One query over ``len(a)`` one-dimensional sources, one head, ``W_O = [1]``."""
    w_o = torch.ones(1, 1)
    S = len(a)
    state = LayerState(layer=0, module=None, value=torch.tensor(v, dtype=torch.float32).reshape(1, 1, S, 1),
                       w_o=w_o, G=M.gram(w_o, 1), G_full=M.full_gram(w_o), kv_head=torch.arange(1),
                       lengths=torch.tensor([S]))
    return Block(state=state, a=torch.tensor(a, dtype=torch.float32).reshape(1, 1, 1, S), q_start=S - 1, k_start=0,
                 learned_sink=None if sink is None else torch.tensor([[[sink]]]))


def test_leave_one_out_hand_case_with_a_learned_sink():
    # o = 0.3·1 + 0.5·2 = 1.3; the sink keeps 0.2 of the row with a zero value.
    # drop j=1: o' = 0.3·1/(1−0.5) = 0.6 → 0.7; drop j=0: o' = 0.5·2/(1−0.3) = 1/0.7 → 1/0.7 − 1.3
    b = _hand_block([0.3, 0.5], [1.0, 2.0], sink=0.2)
    got = b.metric("leave_one_out")[0, 0, 0]
    assert got.tolist() == pytest.approx([1 / 0.7 - 1.3, 0.7], rel=1e-6)
    # without a sink the row renormalises over the other source alone: drop j=1 leaves v_0 = 1
    b = _hand_block([0.4, 0.6], [1.0, 2.0])
    assert b.metric("leave_one_out")[0, 0, 0].tolist() == pytest.approx([2.0 - 1.6, 1.6 - 1.0], rel=1e-6)
    # a query's only source takes the whole output with it
    assert _hand_block([1.0], [3.0]).metric("leave_one_out")[0, 0, 0].tolist() == pytest.approx([3.0])


def test_value_zeroing_and_alti_hand_cases():
    # two heads would need cross terms; one head in one dimension: o = 0.25·4 + 0.75·(−1) = 0.25
    b = _hand_block([0.25, 0.75], [4.0, -1.0])
    # zeroing j=0 leaves −0.75 (opposite direction: distance 2); zeroing j=1 leaves 1.0 (same: 0)
    assert b.metric("value_zeroing")[0, 0, 0].tolist() == pytest.approx([2.0, 0.0], abs=1e-6)
    assert b.token_score("value_zeroing")[0, 0].tolist() == pytest.approx([2.0, 0.0], abs=1e-6)
    # ALTI: |o|₁ = 0.25; |o − z_0|₁ = 0.75 → 0; |o − z_1|₁ = 1.0 → 0: nothing is proximate, all 0
    assert b.token_score("alti")[0, 0].tolist() == [0.0, 0.0]
    # o = 0.5·2 + 0.5·1 = 1.5: |o − z_0| = 0.5 → prox 1.0; |o − z_1| = 1.0 → prox 0.5; shares 2/3, 1/3
    b = _hand_block([0.5, 0.5], [2.0, 1.0])
    assert b.token_score("alti")[0, 0].tolist() == pytest.approx([2 / 3, 1 / 3], rel=1e-6)


def _pieces(h, ids):
    """Per layer from an eager forward: attention [H, T, T], per-query-head values [H, T, d], W_O, and
    the layer's attention output (the o_proj output, no bias in these models) [T, D]."""
    values, outs = {}, {}
    hooks = []
    for l, layer in enumerate(h.model.model.layers):
        hooks.append((layer.self_attn.v_proj, lambda m, a, o, l=l: values.__setitem__(l, o)))
        hooks.append((layer.self_attn.o_proj, lambda m, a, o, l=l: outs.__setitem__(l, o)))
    att = eager_attentions(h, ids, hooks)
    d = h.model.config.hidden_size // h.num_heads
    out = []
    for l in range(len(att)):
        v = values[l][0].reshape(len(ids), h.num_kv_heads, d).transpose(0, 1)
        v = v.repeat_interleave(h.num_heads // h.num_kv_heads, dim=0)
        w_o = h.model.model.layers[l].self_attn.o_proj.weight.detach()
        out.append((att[l][0].double(), v.double(), w_o.double(), outs[l][0].double()))
    return out


def _zeroed_output(h, ids, layer, j):
    """The layer's attention output [T, D] when source ``j``'s values are zeroed (every head) in that layer
    alone: the forward rerun with the value projection's row ``j`` set to 0."""
    got = {}
    attn = h.model.model.layers[layer].self_attn

    def zero(m, a, o):
        o = o.clone()
        o[:, j] = 0
        return o

    hooks = [(attn.v_proj, zero), (attn.o_proj, lambda m, a, o: got.__setitem__("o", o))]
    eager_attentions(h, ids, hooks)
    return got["o"][0].double()


@pytest.fixture(scope="module")
def gqa():
    """A tiny Llama with grouped-query attention (2 value heads for 4 query heads)."""
    h = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2)
    ids = h.encode(TEXT)
    return h, ids, analyze(h, TEXT), _pieces(h, ids)


def test_leave_one_out_equals_dropping_the_source_and_renormalising(gqa):
    h, ids, trace, pieces = gqa
    d = h.model.config.hidden_size // h.num_heads
    T = len(ids)
    for l, (a, v, w_o, _) in enumerate(pieces):
        want = torch.zeros(h.num_heads, T, T, dtype=torch.float64)
        for hd in range(h.num_heads):
            W = w_o[:, hd * d:(hd + 1) * d]
            for i in range(T):
                o = W @ (a[hd, i] @ v[hd])
                for j in range(i + 1):
                    keep = a[hd, i].clone()
                    keep[j] = 0
                    o_drop = W @ ((keep / keep.sum()) @ v[hd]) if keep.sum() > 0 else torch.zeros_like(o)
                    want[hd, i, j] = (o_drop - o).norm()
        got = torch.from_numpy(trace.layers[l].metric("leave_one_out")).double()
        assert torch.allclose(got, want, rtol=2e-4, atol=1e-5), (l, (got - want).abs().max())
        tok = torch.from_numpy(trace.layers[l].token_score("leave_one_out")).double()
        assert torch.allclose(tok, want.sum(0), rtol=2e-4, atol=1e-5)


def test_unrenormalised_leave_one_out_is_value_weighted(gqa):
    """Dropping ``j`` without renormalising moves ``o_i^h`` by ``a_ij^h ṽ_j^h``: its norm is the
    registry's ``value_weighted`` map (so the head-to-head needs no separate entry)."""
    h, ids, trace, pieces = gqa
    d = h.model.config.hidden_size // h.num_heads
    for l, (a, v, w_o, _) in enumerate(pieces):
        want = torch.stack([(a[hd][..., None] * (v[hd] @ w_o[:, hd * d:(hd + 1) * d].t())[None]).norm(dim=-1)
                            for hd in range(h.num_heads)])
        got = torch.from_numpy(trace.layers[l].metric("value_weighted")).double()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)


def test_value_zeroing_equals_zeroing_the_values_and_rerunning_the_layer(gqa):
    h, ids, trace, pieces = gqa
    d = h.model.config.hidden_size // h.num_heads
    T = len(ids)
    for l, (a, v, w_o, o) in enumerate(pieces):
        want = torch.zeros(T, T, dtype=torch.float64)
        for j in range(T):
            o_zero = _zeroed_output(h, ids, l, j)
            cos = torch.nn.functional.cosine_similarity(o, o_zero, dim=-1)
            want[:, j] = torch.where(torch.arange(T) >= j, 1 - cos, torch.zeros_like(cos))
        got = torch.from_numpy(trace.layers[l].token_score("value_zeroing")).double()
        assert torch.allclose(got, want, atol=2e-5), (l, (got - want).abs().max())
        assert float(got.min()) >= 0 and float(got.max()) <= 2        # a cosine distance, rounding included
        # per head: j zeroed in head h alone, the rest of the layer's output kept
        per = torch.zeros(h.num_heads, T, T, dtype=torch.float64)
        for hd in range(h.num_heads):
            W = w_o[:, hd * d:(hd + 1) * d]
            for j in range(T):
                o_zero = o - a[hd, :, j, None] * (v[hd, j] @ W.t())[None]
                cos = torch.nn.functional.cosine_similarity(o, o_zero, dim=-1)
                per[hd, :, j] = torch.where(torch.arange(T) >= j, 1 - cos, torch.zeros_like(cos))
        got = torch.from_numpy(trace.layers[l].metric("value_zeroing")).double()
        assert torch.allclose(got, per, atol=2e-5), (l, (got - per).abs().max())
        assert float(got.min()) >= 0 and float(got.max()) <= 2


def test_alti_equals_its_decomposition_in_model_space(gqa):
    h, ids, trace, pieces = gqa
    d = h.model.config.hidden_size // h.num_heads
    T = len(ids)
    for l, (a, v, w_o, o) in enumerate(pieces):
        z = torch.zeros(T, T, o.shape[-1], dtype=torch.float64)            # z_ij = Σ_h a_ij^h ṽ_j^h
        for hd in range(h.num_heads):
            z += a[hd][..., None] * (v[hd] @ w_o[:, hd * d:(hd + 1) * d].t())[None]
        assert torch.allclose(z.sum(1), o, atol=1e-5)                       # the terms sum to the output
        prox = (o.abs().sum(-1)[:, None] - (o[:, None] - z).abs().sum(-1)).clamp_min(0)
        want = prox / prox.sum(-1, keepdim=True)
        got = torch.from_numpy(trace.layers[l].token_score("alti")).double()
        assert torch.allclose(got, want, atol=2e-5), (l, (got - want).abs().max())
        assert torch.allclose(got.sum(-1), torch.ones(T, dtype=torch.float64), atol=1e-5)


def test_layer_only_measures_refuse_per_head_use(gqa):
    _, _, trace, _ = gqa
    assert {"leave_one_out", "value_zeroing", "alti", "grad_attention", "rollout",
            "contribution_rollout"} <= set(R.rivals())                       # SPEC §2.1's (more may join)
    for name in ("alti", "rollout", "contribution_rollout"):
        assert R.get(name).layer_only and name not in R.per_head_names()
    with pytest.raises(InputError, match="defined on the layer"):
        trace.layers[0].metric("alti")
    with pytest.raises(InputError, match="defined on the layer"):
        Variant("alti", "comprehensiveness", 0.5, per_head=True)
    Variant("alti", "comprehensiveness", 0.5)                                 # ranked per query: fine


def test_the_measures_rank_the_interventions(tiny_llama):
    """Each measure ranks the comprehensiveness and sufficiency interventions (token level); masking
    half of the sources moves the perplexity, each measure its own way."""
    from attngeom.faithfulness import experiment as faithfulness
    from attngeom.faithfulness.settings import FaithfulnessSettings

    ids = tiny_llama.encode(TEXT * 3)
    settings = FaithfulnessSettings(metrics=R.rivals() + ("attention",), ratios=(0.5,), seeds=(0,))
    res = faithfulness.experiment(tiny_llama, None, units=faithfulness.window_units([ids]), settings=settings,
                                  progress=False)
    tab = res.tables["table"]
    assert sorted(tab["metric"]) == sorted(m for m in settings.metrics for _ in range(2))
    assert (tab["change"] != 0).all() and tab["ppl"].notna().all()
    # different rankings mask different sources
    assert tab.groupby("mode")["ppl"].nunique().min() > 1


# --------------------------------------------------------------------------------------------
# Measures computed before the ranked forward: gradient-weighted attention, rollouts
# --------------------------------------------------------------------------------------------


def _eager_gradients(h, ids, n):
    """``a ⊙ ∂ℓ/∂a`` per layer through transformers' own eager attention (``output_attentions``):
    ``ℓ`` the log-likelihood of the last ``n`` tokens."""
    eager = h.model.config._attn_implementation
    h.model.set_attn_implementation("eager")
    try:
        x = torch.tensor([list(ids)])
        with torch.enable_grad():
            out = h.model(input_ids=x, output_attentions=True)
            T = len(ids)
            lp = torch.log_softmax(out.logits[0, T - 1 - n:T - 1].double(), -1)
            ll = lp.gather(-1, x[0, T - n:, None]).sum()
            grads = torch.autograd.grad(ll, list(out.attentions))
        return [(a.detach() * g).double()[0] for a, g in zip(out.attentions, grads)]
    finally:
        h.model.set_attn_implementation(eager)


@pytest.mark.parametrize("n", [None, 3])
def test_gradient_weighted_attention_equals_autograd_through_eager_attention(gqa, n):
    from attngeom.capture.prepared import gradient_maps

    h, ids, _, _ = gqa
    n = len(ids) - 1 if n is None else n
    want = _eager_gradients(h, ids, n)
    got = gradient_maps(h, ids, n)
    assert sorted(got) == list(range(len(want)))
    for l, w in enumerate(want):
        g = got[l][0].double()
        assert g.shape == w.shape
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-6 * float(w.abs().max())), (l, (g - w).abs().max())
        assert float(g.abs().max()) > 0 and float(g.triu(1).abs().max()) == 0      # causal: nothing ahead


def test_gradient_weighted_attention_predicts_the_masking_to_first_order(gqa):
    """``Σ g_ij`` over a small masked share ``ε`` of every weight of one layer is the first-order change
    of ``ℓ``: scaling the mixing weights of layer 1 by ``1 − ε`` (an intervention of the plug-in)
    changes ``ℓ`` by ``−ε Σ g`` up to ``O(ε²)``."""
    from attngeom.capture.session import Session
    from attngeom.capture.prepared import gradient_maps
    from attngeom.streaming.passes import batch_nll
    from attngeom.streaming.reducers import InputBatch

    h, ids, _, _ = gqa
    g = gradient_maps(h, ids, len(ids) - 1)[1]
    batch = InputBatch(ids=torch.tensor([list(ids)]), lengths=torch.tensor([len(ids)]), index=[0])

    def ll(eps):
        scaled = Session(intervention=lambda b: b.a * (1 - eps) if b.layer == 1 else None)
        return -float(batch_nll(h, batch, scaled)[0])

    eps = 1e-2
    slope = (ll(eps) - ll(-eps)) / (2 * eps)
    assert slope == pytest.approx(-float(g.sum()), rel=2e-2, abs=1e-3)


def test_rollout_compose_hand_case():
    from attngeom.metrics.rollout import compose

    A1 = torch.tensor([[[1.0, 0.0], [0.6, 0.4]]])
    A2 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    R1, R2 = compose([A1, A2])
    # ½A1 + ½I = [[1, 0], [0.3, 0.7]]; ½A2 + ½I = I: the second layer changes nothing
    assert torch.allclose(R1[0], torch.tensor([[1.0, 0.0], [0.3, 0.7]]))
    assert torch.allclose(R2, R1)
    assert torch.allclose(R1.sum(-1), torch.ones(1, 2))


def test_rollouts_equal_their_composition_of_eager_maps(gqa):
    from attngeom.capture.prepared import rollout_maps

    h, ids, trace, pieces = gqa
    T = len(ids)
    got = rollout_maps(h, ids, "attention")
    R = torch.eye(T, dtype=torch.float64)
    for l, (a, _, _, _) in enumerate(pieces):
        R = (0.5 * a.mean(0) + 0.5 * torch.eye(T, dtype=torch.float64)) @ R
        assert torch.allclose(got[l][0].double(), R, atol=1e-5), l
        assert torch.allclose(got[l][0].sum(-1).double(), torch.ones(T, dtype=torch.float64), atol=1e-5)
    got = rollout_maps(h, ids, "contribution")
    R = torch.eye(T, dtype=torch.float64)
    for l in range(len(pieces)):
        C = torch.from_numpy(trace.layers[l].token_score("contribution")).double()          # [T, T]
        R = (0.5 * C + 0.5 * torch.eye(T, dtype=torch.float64)) @ R
        assert torch.allclose(got[l][0].double(), R, atol=1e-5), l


def test_prepared_measures_refuse_a_forward_without_their_pass(gqa):
    """A block reads a gradient or rollout only from the pass run before its forward: analysing a text
    alone says so in one line instead of ranking by zeros."""
    h = gqa[0]
    for name in ("grad_attention", "rollout"):
        with pytest.raises(InputError, match="computed from the clean forward"):
            _read_in_a_forward(h, name)


def _read_in_a_forward(h, name):
    from attngeom.capture.session import Session
    from attngeom.streaming.passes import forward
    from attngeom.streaming.reducers import InputBatch

    class Read:
        needs = frozenset({"attention"})

        def observe(self, block):
            block.token_score(name)

    ids = h.encode(TEXT)
    forward(h, InputBatch(ids=torch.tensor([ids]), lengths=torch.tensor([len(ids)]), index=[0]), Session([Read()]))


def test_prepared_maps_rank_a_batch_of_variants_like_one_row(tiny_llama):
    """The prepared maps of one text serve every row of a batched forward: ranking by gradient or
    rollout in a batch of variants gives each variant's NLL as run alone."""
    from attngeom.faithfulness.experiment import Unit, pair_nll

    ids = tiny_llama.encode(TEXT * 2)
    unit = Unit(tuple(ids), len(ids) - 1, 0)
    chunk = [Variant(m, mode, 0.4) for m in ("grad_attention", "rollout", "contribution_rollout")
             for mode in ("comprehensiveness", "sufficiency")]
    cache: dict = {}
    together = pair_nll(tiny_llama, unit, chunk, None, cache)
    assert list(cache) == [unit.digest]
    assert set(cache[unit.digest]) == {"grad_attention", "rollout", "contribution_rollout"}
    alone = [pair_nll(tiny_llama, unit, [v], None)[0] for v in chunk]
    assert together == pytest.approx(alone, rel=1e-5)
    assert len(set(round(x, 4) for x in together)) == len(chunk)


def test_analyze_prepares_gradients_and_rollouts_on_request(gqa):
    from attngeom.capture.prepared import gradient_maps, rollout_maps

    h, ids, _, _ = gqa
    trace = analyze(h, TEXT, prepare=["grad_attention", "rollout"])
    g, r = gradient_maps(h, ids, len(ids) - 1), rollout_maps(h, ids)
    for l, layer in enumerate(trace.layers):
        assert torch.allclose(torch.from_numpy(layer.metric("grad_attention")), g[l][0], atol=1e-7)
        assert torch.allclose(torch.from_numpy(layer.token_score("grad_attention")), g[l][0].sum(0), atol=1e-6)
        assert torch.allclose(torch.from_numpy(layer.token_score("rollout")), r[l][0])
    with pytest.raises(InputError, match="computed from the clean forward"):
        trace.layers[0].token_score("contribution_rollout")            # not asked for
    with pytest.raises(InputError, match="needs no pass"):
        analyze(h, TEXT, prepare=["contribution"])
    with pytest.raises(InputError, match="not of a generation"):
        analyze(h, TEXT, prepare=["rollout"], generate=2)


def test_both_rollouts_share_one_forward_and_equal_each_alone(gqa):
    """``prepare`` records every rollout's maps in one clean forward: the same maps as each
    rollout's own pass, bit for bit, for one forward instead of one per rollout."""
    from attngeom.capture.prepared import prepare, rollout_maps

    h, ids, _, _ = gqa
    calls = []
    hook = h.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        both = prepare(h, ids, len(ids) - 1, ["rollout", "contribution_rollout"])
    finally:
        hook.remove()
    assert len(calls) == 1
    alone = {"rollout": rollout_maps(h, ids, "attention"), "contribution_rollout": rollout_maps(h, ids, "contribution")}
    assert sorted(both) == sorted(alone["rollout"])
    for layer, maps in both.items():
        assert sorted(maps) == ["contribution_rollout", "rollout"]
        for name, m in maps.items():
            assert torch.equal(m, alone[name][layer]), (name, layer)
