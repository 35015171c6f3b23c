"""The architecture adapter (``handle.adapter``): the one place that knows where each architecture
keeps its attention modules, decoder layers, ``W_O`` and ``W_V`` (fused ``qkv_proj`` included)."""

from __future__ import annotations

import pytest
import torch

from attngeom.capture.kernel import output_grams

from attngeom.capture.session import Session
from attngeom.errors import UnsupportedArchitectureError
from attngeom.model import SUPPORTED_ARCHITECTURES, ArchitectureAdapter, HeadGeometry, adapter_for
from attngeom.model.adapter import attention_layer, attention_w_o
from attngeom.streaming.reducers import InputBatch
from attngeom.streaming import forward
from tiny_models import ARCHS, tiny_model

T = 20


def _ids(handle, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, handle.model.config.vocab_size, (T,), generator=g)
    ids[0] = handle.tokenizer.bos_token_id
    return ids


def test_the_tiny_architectures_are_verified_ones():
    assert set(ARCHS) <= set(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("arch", ARCHS)
def test_geometry_and_modules(arch):
    handle = tiny_model(arch)
    ad = handle.adapter
    assert isinstance(ad, ArchitectureAdapter)
    assert handle.adapter is ad and adapter_for(handle.model) is ad  # discovered once per model
    cfg = handle.config
    g = ad.geometry
    assert isinstance(g, HeadGeometry)
    assert g.num_layers == cfg.num_hidden_layers == handle.num_layers
    assert g.num_heads == cfg.num_attention_heads == handle.num_heads
    assert g.num_kv_heads == handle.num_kv_heads == getattr(cfg, "num_key_value_heads", g.num_heads)
    assert g.head_dim == handle.head_dim == g.qk_head_dim and g.hidden_size == cfg.hidden_size
    assert g.group_size == g.num_heads // g.num_kv_heads
    assert g.kv_head().tolist() == [h // g.group_size for h in range(g.num_heads)]

    layers = handle.model.model.layers
    assert list(ad.attention_modules) == list(range(g.num_layers))
    assert ad.decoder_layers == list(layers) and ad.decoder_index == list(range(g.num_layers))
    assert not ad.hybrid
    D, H, Hkv, d = g.hidden_size, g.num_heads, g.num_kv_heads, g.head_dim
    for l in range(g.num_layers):
        attn = ad.attention(l)
        assert attn is layers[l].self_attn and attention_layer(attn) == l == attn.layer_idx
        assert ad.decoder_layer(l) is layers[l]
        assert ad.o_proj(l) is attn.o_proj and ad.b_o(l) is None
        assert ad.w_o(l) is attn.o_proj.weight and attention_w_o(attn) is attn.o_proj.weight
        assert ad.w_o(l).shape == (D, H * d)
        assert ad.w_v(l).shape == (Hkv * d, D)
        assert ad.w_o_heads(l).shape == (H, d, D) and ad.w_v_heads(l).shape == (Hkv, d, D)
        torch.testing.assert_close(ad.w_o_heads(l)[1], attn.o_proj.weight[:, d:2 * d].t())
    with pytest.raises(IndexError, match="layer"):
        ad.attention(g.num_layers)


def test_fused_qkv_value_rows():
    handle = tiny_model("phi3")
    ad = handle.adapter
    g = ad.geometry
    qkv = ad.attention(0).qkv_proj.weight
    start = (g.num_heads + g.num_kv_heads) * g.head_dim
    assert qkv.shape[0] == start + g.num_kv_heads * g.head_dim
    torch.testing.assert_close(ad.w_v(0), qkv[start:])
    assert ad.w_v(0).data_ptr() == qkv[start:].data_ptr()  # a view, not a copy
    assert ad.b_v(0) is None


def test_conv1d_output_projection_and_interleaved_values():
    """GPT-2's Conv1D holds ``W_O`` transposed (read as a view) and has a bias; GPT-NeoX interleaves
    q, k, v per head in one ``query_key_value`` (the value rows are found head by head)."""
    import transformers

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=64)).eval()
    ad = adapter_for(gpt2)
    attn = gpt2.transformer.h[1].attn
    assert ad.o_proj(1) is attn.c_proj and ad.sites[1].out.kind == "transposed"
    assert ad.w_o(1).shape == (32, 32) and ad.w_o(1).data_ptr() == attn.c_proj.weight.data_ptr()
    torch.testing.assert_close(ad.w_o(1), attn.c_proj.weight.t())
    assert ad.b_o(1) is attn.c_proj.bias
    torch.testing.assert_close(ad.w_v(1), attn.c_attn.weight.t()[64:96])
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64, vocab_size=64)).eval()
    ad = adapter_for(neox)
    qkv = neox.gpt_neox.layers[0].attention.query_key_value
    rows = torch.cat([torch.arange(h * 24 + 16, h * 24 + 24) for h in range(4)])   # per head: q 8, k 8, v 8
    torch.testing.assert_close(ad.w_v(0), qkv.weight[rows])
    torch.testing.assert_close(ad.b_v(0), qkv.bias[rows])


def test_what_discovery_cannot_establish_is_refused_in_one_line():
    """A gate between the attention output and the output projection (Qwen3-Next) leaves no module
    receiving the attention output: W_O is not guessed."""
    import transformers

    cfg = transformers.AutoConfig.for_model("qwen3_next", vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=16,
                                            layer_types=["linear_attention", "full_attention"])
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(UnsupportedArchitectureError) as info:
        adapter_for(model)
    msg = str(info.value)
    assert msg.startswith("qwen3_next: model.layers.1.self_attn:") and "W_O" in msg and "\n" not in msg


class _Values:
    """Records each layer's value states as the attention function received them."""

    def __init__(self):
        self.v = {}

    def observe(self, block):
        self.v.setdefault(block.layer, block.state.v.clone())


class _AttentionInputs:
    """The hidden states entering each attention module (after the input norm)."""

    def __init__(self, adapter):
        self.x, self.hooks = {}, []
        for l, attn in adapter.attention_modules.items():
            self.hooks.append(attn.register_forward_pre_hook(self._hook(l), with_kwargs=True))

    def _hook(self, l):
        def record(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            self.x[l] = x.detach().clone()
        return record

    def remove(self):
        for h in self.hooks:
            h.remove()


@pytest.mark.parametrize("arch", ARCHS)
def test_w_v_gives_the_values_the_model_uses(arch):
    """``x W_Vᵀ + b_V`` equals the value states the attention function receives, for every layer
    (fused qkv_proj, value bias, GQA/MQA included)."""
    handle = tiny_model(arch)
    ad = handle.adapter
    g = ad.geometry
    ids = _ids(handle)
    values = _Values()
    inputs = _AttentionInputs(ad)
    try:
        forward(handle, InputBatch(ids=ids[None], lengths=torch.tensor([T]), index=[0]), Session(observers=[values]))
    finally:
        inputs.remove()
    assert sorted(values.v) == list(range(g.num_layers))
    for l in range(g.num_layers):
        x = inputs.x[l].float()                                                # [1, T, D]
        v = torch.nn.functional.linear(x, ad.w_v(l).float(), None if ad.b_v(l) is None else ad.b_v(l).float())
        v = v.view(1, T, g.num_kv_heads, g.head_dim).transpose(1, 2)          # [1, Hkv, T, d]
        v = v[:, g.kv_head()]                                                 # per query head
        torch.testing.assert_close(values.v[l], v, rtol=1e-5, atol=1e-5)
    if arch == "qwen2":
        assert ad.b_v(0) is not None


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_reads_w_o_through_the_adapter(arch):
    handle = tiny_model(arch)
    ad = handle.adapter
    w_o, G, _ = output_grams(ad.attention(0), ad.num_heads)
    torch.testing.assert_close(w_o, ad.w_o(0).float())
    d = ad.head_dim
    torch.testing.assert_close(G[0], ad.w_o(0)[:, :d].t().float() @ ad.w_o(0)[:, :d].float())


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gemma3_text"])
def test_layer_types_and_sliding_windows(arch):
    handle = tiny_model(arch)
    ad = handle.adapter
    cfg = handle.config
    expected = getattr(cfg, "layer_types", None)
    if arch == "llama":
        expected = ["full_attention"] * ad.num_layers
    elif arch == "mistral":
        expected = ["sliding_attention"] * ad.num_layers
    assert ad.layer_types == list(expected)
    for l, kind in enumerate(ad.layer_types):
        assert ad.sliding_window(l) == (cfg.sliding_window if kind == "sliding_attention" else None)


def test_adapter_follows_a_replaced_model():
    handle = tiny_model("llama")
    first = handle.adapter
    handle.model = tiny_model("phi3").model
    assert handle.adapter is not first and handle.adapter.architecture == "phi3"


def test_heads_helpers_go_through_the_adapter():
    from attngeom.heads import experiment as HD

    handle = tiny_model("phi3")
    assert HD.attention_modules(handle.model) == handle.adapter.attention_modules
    w = HD.weight_norms(handle)
    ad = handle.adapter
    wo = ad.w_o_heads(1).flatten(1).norm(dim=1)
    wv = ad.w_v_heads(1).flatten(1).norm(dim=1)[ad.geometry.kv_head()]
    assert w.shape == (ad.num_layers, ad.num_heads)
    torch.testing.assert_close(torch.from_numpy(w[1]).float(), wo * wv)


def test_no_forward_is_replaced():
    """Reading the structure never wraps or replaces a module's forward."""
    handle = tiny_model("gemma3_text")
    before = {name: m.__dict__.get("forward") for name, m in handle.model.named_modules()}
    ad = handle.adapter
    for l in range(ad.num_layers):
        ad.w_o(l), ad.w_v(l), ad.b_v(l), ad.sliding_window(l)
    ad.decoder_layers
    after = {name: m.__dict__.get("forward") for name, m in handle.model.named_modules()}
    assert before == after and all(f is None for f in after.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_delta_is_what_attention_adds_to_the_residual(arch):
    """Decoder-layer input + the delta module's output = the residual stream the MLP side reads
    (the input of Gemma 2/3's ``pre_feedforward_layernorm``, else of ``post_attention_layernorm``)."""
    handle = tiny_model(arch)
    ad = handle.adapter
    seen, hooks = {}, []
    for l, layer in enumerate(ad.decoder_layers):
        mlp_norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
        hooks += [
            layer.register_forward_pre_hook(
                lambda m, a, kw, l=l: seen.__setitem__(("x", l), (a[0] if a else kw["hidden_states"]).clone()),
                with_kwargs=True),
            ad.attention_delta_module(l).register_forward_hook(
                lambda m, a, out, l=l: seen.__setitem__(("d", l), (out[0] if isinstance(out, tuple) else out).clone())),
            mlp_norm.register_forward_pre_hook(lambda m, a, l=l: seen.__setitem__(("r", l), a[0].clone())),
        ]
    try:
        with torch.no_grad():
            handle.model(_ids(handle)[None])
    finally:
        for h in hooks:
            h.remove()
    for l in range(ad.num_layers):
        torch.testing.assert_close(seen["x", l] + seen["d", l], seen["r", l])


def test_a_dropped_model_is_freed():
    """Discovery's tables hold models and modules weakly: analysing a model does not keep it alive."""
    import gc
    import weakref

    from attngeom.traces.trace import analyze

    handle = tiny_model("llama")
    analyze(handle, "The cat sat.")
    ref = weakref.ref(handle.model)
    del handle
    gc.collect()
    assert ref() is None
