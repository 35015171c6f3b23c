"""Capture is exact: for every supported architecture the captured pieces rebuild the module's own
attention output, and logits with analysis on equal logits without it."""

import pytest
import torch

from attngeom.capture.session import ATTN_NAME, attngeom_attention_implementation, Session
from attngeom.streaming.reducers import InputBatch, HeadStats
from attngeom.traces.trace import analyze, analyze_batch
from attngeom.streaming import forward
from tiny_models import ARCHS, tiny_model
from checks import o_proj_inputs

T = 24


def _ids(handle, T=T, seed=1):
    g = torch.Generator().manual_seed(seed)
    vocab = handle.model.config.vocab_size
    ids = torch.randint(3, vocab, (T,), generator=g)
    if handle.tokenizer.bos_token_id is not None:
        ids[0] = handle.tokenizer.bos_token_id
    return ids


def _reference_impl(handle):
    """The module's own attention: SDPA, or eager where SDPA cannot express it (soft-capping)."""
    cfg = handle.model.config
    return "eager" if getattr(cfg, "attn_logit_softcapping", None) else "sdpa"


@pytest.mark.parametrize("arch", ARCHS)
def test_reconstructs_module_output(arch):
    handle = tiny_model(arch)
    model = handle.model
    ids = _ids(handle)
    model.set_attn_implementation(_reference_impl(handle))
    with torch.no_grad():
        own, ref = o_proj_inputs(handle.adapter, lambda: model(ids[None]).logits, T)
    trace = analyze(handle, ids, block_elements=256)  # many small blocks
    assert [lt.index for lt in trace.layers] == sorted(own)
    for lt in trace.layers:
        rebuilt = torch.einsum("hts,hsd->thd", lt.a, lt.v).reshape(T, -1)
        target = own[lt.index][0]
        rel = (rebuilt - target).norm() / target.norm()
        assert rel < 1e-5, (arch, lt.index, float(rel))
        # model space: o_i is the o_proj output without its bias
        o = torch.from_numpy(lt.output_norm)
        proj = torch.nn.functional.linear(target, lt.w_o)
        assert torch.allclose(o, proj.norm(dim=-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_unchanged_by_analysis(arch):
    handle = tiny_model(arch)
    model = handle.model
    ids = _ids(handle)
    model.set_attn_implementation(_reference_impl(handle))
    with torch.no_grad():
        ref = model(ids[None]).logits.float()
    stats = HeadStats()
    session = Session(observers=[stats], block_elements=300)
    batch = InputBatch(ids=ids[None], lengths=torch.tensor([T]), index=[0])
    got = forward(handle, batch, session, logits=True)
    assert session.layers_seen == list(range(model.config.num_hidden_layers))
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), float((got - ref).abs().max())
    # the model is back on its own implementation afterwards
    assert model.config._attn_implementation == _reference_impl(handle)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_plugin_without_session_is_the_plain_model(arch):
    """Left on "attngeom" with no session, a model computes what it computed before (the mask
    function registered under the same name gives the mask format the function expects)."""
    handle = tiny_model(arch)
    model = handle.model
    ids = _ids(handle)
    model.set_attn_implementation(_reference_impl(handle))
    with torch.no_grad():
        ref = model(ids[None]).logits
        with attngeom_attention_implementation(model):
            assert model.config._attn_implementation == ATTN_NAME
            got = model(ids[None]).logits
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3_text"])
def test_sliding_window_respected(arch):
    handle = tiny_model(arch)
    cfg = handle.model.config
    window = cfg.sliding_window
    assert window is not None and window < T
    trace = analyze(handle, _ids(handle), block_elements=200)
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    saw_sliding = False
    for lt, kind in zip(trace.layers, types):
        i, j = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
        outside = j > i
        if kind == "sliding_attention":
            outside |= (i - j) >= window
            saw_sliding = True
        assert float(lt.a[:, outside].abs().max()) == 0.0
        assert torch.allclose(lt.a.sum(-1), torch.ones(lt.a.shape[:2]), atol=1e-5)
    assert saw_sliding


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_batch_with_padding_equals_one_at_a_time(arch):
    handle = tiny_model(arch)
    texts = [_ids(handle, T=n, seed=n) for n in (7, 19, 12)]
    batched = analyze_batch(handle, texts, batch_size=3, block_elements=500)
    for ids, tb in zip(texts, batched):
        single = analyze(handle, ids)
        assert tb.ids == ids.tolist()
        for lb, ls in zip(tb.layers, single.layers):
            for name in ("attention", "contribution", "contribution_inter", "output_normalized"):
                assert abs(getattr(lb, name) - getattr(ls, name)).max() < 1e-5, (arch, name)


def test_layers_subset_and_block_sizes_agree():
    handle = tiny_model("llama")
    ids = _ids(handle)
    whole = analyze(handle, ids)
    part = analyze(handle, ids, layers=[1], block_elements=64)
    assert [lt.index for lt in part.layers] == [1]
    assert abs(part.layers[1].contribution - whole.layers[1].contribution).max() < 1e-5
