"""The papers' seed architectures at full width, with random weights, cut to a few decoder layers.

The values are the public ``config.json`` of each checkpoint (not downloaded; written out here):

==================  ==========  ======  =====  ====  ======  ======  ========  ==========================================
name                model_type  hidden  inter  q/kv  head_d  layers  vocab     attention specifics
==================  ==========  ======  =====  ====  ======  ======  ========  ==========================================
llama3.1-8b         llama       4096    14336  32/8  128     32      128256    rope "llama3": factor 8, low 1, high 4,
                                                                               original_max_position 8192, theta 500000
mistral-7b-v0.1     mistral     4096    14336  32/8  128     32      32000     sliding_window 4096 (every layer)
qwen3-8b            qwen3       4096    12288  32/8  128     36      151936    q/k RMS norms, theta 1e6, no qkv bias
deepseek-llm-7b     llama       4096    11008  32/32 128     30      102400    plain LLaMA, MHA
gemma-7b            gemma       3072    24576  16/16 256     28      256000    head_dim 256 (q width 4096 != hidden)
gemma-2-9b          gemma2      3584    14336  16/8  256     42      256000    soft-capping attn 50 / final 30,
                                                                               sliding 4096 / global alternating,
                                                                               query_pre_attn_scalar 256
==================  ==========  ======  =====  ====  ======  ======  ========  ==========================================

:func:`seed_model` builds one with random weights (``initializer_range`` 0.02, as published), in
bf16 by default, cut to ``layers`` decoder layers (2 by default; Gemma-2 keeps its sliding/global
alternation: layer 0 sliding, layer 1 global) and with the vocabulary reduced to ``vocab`` rows
(8192 by default: the embedding and LM-head matrices are the only thing it changes, and at full
vocabulary they dominate memory, e.g. 2 x 1.05 GB for LLaMA-3.1 in bf16). Every attention module
is exactly the published one: width, heads, head_dim, RoPE (with its scaling), norms, windows,
soft-capping and scaling are untouched. Token ids 0/1/2 are pad/BOS/EOS (the tiny test tokenizer's).
"""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM

from attngeom.model import ModelHandle

SEED_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama3.1-8b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_hidden_layers=32, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        attention_bias=False, mlp_bias=False, hidden_act="silu", tie_word_embeddings=False,
    )),
    "mistral-7b-v0.1": ("MistralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_hidden_layers=32, vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=10000.0, sliding_window=4096, hidden_act="silu", tie_word_embeddings=False,
    )),
    "qwen3-8b": ("Qwen3Config", dict(
        hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, num_hidden_layers=36, vocab_size=151936, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False, use_sliding_window=False,
        sliding_window=None, hidden_act="silu", tie_word_embeddings=False,
    )),
    "deepseek-llm-7b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
        num_hidden_layers=30, vocab_size=102400, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=10000.0, attention_bias=False, hidden_act="silu", tie_word_embeddings=False,
    )),
    "gemma-7b": ("GemmaConfig", dict(
        hidden_size=3072, intermediate_size=24576, num_attention_heads=16, num_key_value_heads=16,
        head_dim=256, num_hidden_layers=28, vocab_size=256000, max_position_embeddings=8192,
        rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    )),
    "gemma-2-9b": ("Gemma2Config", dict(
        hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, num_hidden_layers=42, vocab_size=256000, max_position_embeddings=8192,
        rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, hidden_activation="gelu_pytorch_tanh",
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        query_pre_attn_scalar=256, tie_word_embeddings=True,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(42)],
    )),
}

SEED_NAMES = tuple(SEED_CONFIGS)
DEFAULT_VOCAB = 8192
DEFAULT_LAYERS = 2


def published(name: str) -> dict:
    """The published values of ``name`` (a copy)."""
    if name not in SEED_CONFIGS:
        raise KeyError(f"unknown seed architecture {name!r}; known: {', '.join(SEED_NAMES)}")
    return dict(SEED_CONFIGS[name][1])


def seed_config(name: str, layers: int = DEFAULT_LAYERS, vocab: int | None = DEFAULT_VOCAB, **overrides):
    """The config of ``name`` cut to ``layers`` decoder layers and ``vocab`` rows (None: published)."""
    cls_name = SEED_CONFIGS[name][0] if name in SEED_CONFIGS else None
    kw = published(name)
    kw["num_hidden_layers"] = layers
    if "layer_types" in kw:
        kw["layer_types"] = kw["layer_types"][:layers]
    if vocab is not None:
        kw["vocab_size"] = vocab
    kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    kw.update(overrides)
    return getattr(transformers, cls_name)(**kw)


def reference_implementation(config) -> str:
    """The module's own attention: SDPA, or eager where SDPA cannot express it (soft-capping)."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"


def seed_model(name: str, layers: int = DEFAULT_LAYERS, vocab: int | None = DEFAULT_VOCAB,
               dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str | torch.device = "cpu",
               attn_implementation: str | None = None, **overrides) -> ModelHandle:
    """A random-weight ``name`` (see the module docstring) as a :class:`ModelHandle` with the tiny
    test tokenizer (ids 0..127; any id below ``vocab`` may be fed directly)."""
    from tiny_models import tiny_tokenizer

    config = seed_config(name, layers, vocab, **overrides)
    impl = attn_implementation or reference_implementation(config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=impl)
    model.eval()
    return ModelHandle(model=model, tokenizer=tiny_tokenizer(), spec=f"seed-{name}", name=f"{name} ({layers} layers)")


def random_ids(vocab: int, T: int, seed: int = 1) -> torch.Tensor:
    """``T`` random token ids in ``[3, vocab)`` with BOS (1) first."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (T,), generator=g)
    ids[0] = 1
    return ids
