"""Head removal (SPEC §6): zeroing heads equals zeroing their o_proj input slices (GQA, MQA, fused
qkv), batched single-head sensitivity equals one-at-a-time removal, orders, critical heads, CLI."""

from __future__ import annotations


import numpy as np
import pandas as pd
import pytest
import torch

from attngeom.heads import experiment as HD
from attngeom.heads import orders as HO
from attngeom.capture.session import Session
from attngeom.errors import InputError
from attngeom.streaming import forward, make_batches

from tiny_models import tiny_model

TEXTS = ["The cat sat on the mat; the dog lay by the door.", "A shorter one, with commas."]


def _logits(handle, session, hook_layer=None, hook_slice=None):
    batch = next(make_batches(handle, TEXTS, 2))
    handles = []
    if hook_layer is not None:
        mod = HD.attention_modules(handle.model)[hook_layer]

        def pre(m, args):
            x = args[0].clone()
            if hook_slice is None:
                x.zero_()
            else:
                x[..., hook_slice] = 0
            return (x,) + tuple(args[1:])

        handles.append(mod.o_proj.register_forward_pre_hook(pre))
    try:
        return forward(handle, batch, session, logits=True), batch
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch", ["llama", "mistral", "phi3", "qwen3"])
def test_all_heads_of_a_layer_equal_removing_its_attention_output(arch):
    h = tiny_model(arch)
    layer = 1
    removed, batch = _logits(h, Session(intervention=HD.HeadRemoval({layer: range(h.num_heads)})))
    hooked, _ = _logits(h, Session(), hook_layer=layer)
    base, _ = _logits(h, Session())
    valid = batch.attention_mask.bool()
    assert torch.allclose(removed[valid], hooked[valid], atol=1e-5)
    assert (removed[valid] - base[valid]).abs().max() > 1e-3   # the removal did something


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_one_head_equals_zeroing_its_slice_under_gqa(arch):
    h = tiny_model(arch)
    d = h.head_dim
    for head in (0, h.num_heads - 1):
        removed, batch = _logits(h, Session(intervention=HD.HeadRemoval([(0, head)])))
        hooked, _ = _logits(h, Session(), hook_layer=0, hook_slice=slice(head * d, (head + 1) * d))
        valid = batch.attention_mask.bool()
        assert torch.allclose(removed[valid], hooked[valid], atol=1e-5)


def test_batched_sensitivity_equals_one_at_a_time():
    h = tiny_model("llama")
    ws = [h.encode(TEXTS[0]), h.encode(TEXTS[1])]
    base = HD.removal_perplexity(h, ws)
    sens = HD.single_head_sensitivity(h, ws, batch_size=5, base_ppl=base, progress=False)
    slow = np.array([[HD.removal_perplexity(h, ws, [(l, k)]) - base for k in range(h.num_heads)] for l in range(h.num_layers)])
    assert sens.shape == (h.num_layers, h.num_heads)
    assert np.allclose(sens, slow, rtol=1e-5, atol=1e-6)
    assert np.abs(sens).max() > 0


def test_weight_norms_match_manual():
    for arch in ("llama", "phi3"):
        h = tiny_model(arch)
        w = HD.weight_norms(h)
        H, Hkv, d = h.num_heads, h.num_kv_heads, h.head_dim
        attn = HD.attention_modules(h.model)[0]
        wo = attn.o_proj.weight.detach()
        wv = attn.v_proj.weight.detach() if hasattr(attn, "v_proj") else attn.qkv_proj.weight.detach()[-Hkv * d:]
        for head in range(H):
            g = head // (H // Hkv)
            ref = wo[:, head * d:(head + 1) * d].norm() * wv[g * d:(g + 1) * d].norm()
            assert w[0, head] == pytest.approx(float(ref), rel=1e-5)


def test_removed_at_and_retention_checks():
    order = [(l, h) for l in range(3) for h in range(4)]
    assert HO.removed_at(order, 100) == []
    assert len(HO.removed_at(order, 75)) == 3 and HO.removed_at(order, 75) == order[:3]
    assert len(HO.removed_at(order, 25)) == 9
    assert HD.check_retentions([25, 100, 50]) == [100.0, 50.0, 25.0]
    for bad in ([0], [100.5], [-10], [float("nan")], []):
        with pytest.raises(InputError):
            HD.check_retentions(bad)


def _tax(L=3, H=4):
    rows = []
    regs = ["Retriever", "Mixer", "Reset"]
    for l in range(L):
        for h in range(H):
            reg = regs[(l + h) % 3]
            share = 0.4 + 0.05 * h
            rows.append({"layer": l, "head": h, "regime": reg, "entropy": float(l * H + h),
                         "winner_self": share if reg == "Retriever" else 0.1,
                         "winner_sink": share if reg == "Mixer" else 0.1,
                         "winner_other": share if reg == "Reset" else 0.1})
    return pd.DataFrame(rows)


def test_orders_are_permutations_and_follow_their_rule():
    tax = _tax()
    weights = np.arange(12, dtype=float).reshape(3, 4)[::-1].copy()   # smallest = last layer
    sens = np.random.default_rng(0).normal(size=(3, 4))
    orders = HO.build_orders(tax, weights, sens, ["Mixer", "Reset", "Retriever"], seed=1)
    assert set(orders) == set(HO.ORDERS)
    for o in orders.values():
        assert sorted(o) == [(l, h) for l in range(3) for h in range(4)]
    regime = {(r.layer, r.head): r.regime for r in tax.itertuples()}
    seq = [regime[x] for x in orders["taxonomy"]]
    assert seq == sorted(seq, key=["Mixer", "Reset", "Retriever"].index)
    assert orders["weight"][0] == (2, 0)      # smallest weight product first
    assert orders["entropy"][0] == (2, 3)     # largest entropy first
    assert orders["sensitivity"][0] == tuple(int(x) for x in np.unravel_index(sens.argmin(), sens.shape))
    assert orders["random"] == HO.build_orders(tax, weights, sens, ["Mixer", "Reset", "Retriever"], seed=1)["random"]


def test_critical_heads_rule():
    tax = _tax()
    rng = np.random.default_rng(0)
    sens = rng.normal(1.0, 0.1, size=(3, 4))
    assert HO.critical_heads(sens, tax) == []
    sens[1, 2] = 50.0
    crit = HO.critical_heads(sens, tax)
    assert [(c["layer"], c["head"]) for c in crit] == [(1, 2)]
    assert crit[0]["regime"] == tax.set_index(["layer", "head"]).loc[(1, 2), "regime"]
    assert crit[0]["z"] > 3


# ------------------------------------------------------------------------------------------------
# CLI end to end
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_sensitivity_batches_equal_one_removal_at_a_time_and_replace_no_forward(arch):
    h = tiny_model(arch)
    ws = [h.encode(TEXTS[0]), h.encode(TEXTS[1])]
    replaced = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: replaced.append(mod) if "forward" in vars(mod) else None)
             for m in h.model.modules()]
    try:
        batched = HD.single_head_sensitivity(h, ws, batch_size=8, progress=False)
    finally:
        for k in hooks:
            k.remove()
    assert replaced == []  # no module's forward is replaced on the way
    base = HD.removal_perplexity(h, ws)
    one = np.array([[HD.removal_perplexity(h, ws, [(l, k)]) - base for k in range(h.num_heads)] for l in range(h.num_layers)])
    assert np.allclose(batched, one, rtol=1e-5, atol=1e-6)


