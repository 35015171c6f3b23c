"""Tiny randomly initialised models of every supported architecture, for fast tests.

``tiny_model(arch)`` returns a :class:`attngeom.model.ModelHandle` around a float32, eval-mode model
with vocab 128 and hidden size 64, built from the architecture's config class, and a small
character-level byte-level tokenizer built in code (no network, no files).

The configs differ on purpose, so tests see the variety real models have:

============  ======  ========  =========  ===========================================================
arch          layers  q heads   kv heads   notes
============  ======  ========  =========  ===========================================================
llama         3       4         2 (GQA)
mistral       2       4         1 (MQA)    sliding_window=8 (every layer)
qwen2         2       4         2          q/k/v bias (architecture default), no o_proj bias
qwen3         2       4         2          head_dim=32 != hidden/heads, q/k norms
gemma         2       4         4 (MHA)    head_dim=16
gemma2        2       4         2          sliding/full alternating, window 8, attn_logit_softcapping,
                                           final_logit_softcapping, query_pre_attn_scalar=24, eager
gemma3_text   3       4         2          sliding, sliding, full; window 8; q/k norms
phi3          2       4         2          fused qkv_proj
============  ======  ========  =========  ===========================================================

``initializer_range`` is 0.2 (not the usual 0.02) so attention is far from uniform.
"""

from __future__ import annotations

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from attngeom.model import ModelHandle

VOCAB_SIZE = 128
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
)

# Per-architecture config class and overrides of _COMMON.
_SPECS = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=3, attention_bias=False)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, sliding_window=8)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict(head_dim=32, attention_bias=False)),
    "gemma": ("GemmaConfig", dict(num_key_value_heads=4, head_dim=16, attention_bias=False)),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            query_pre_attn_scalar=24,
            attention_bias=False,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            attention_bias=False,
        ),
    ),
    "phi3": ("Phi3Config", dict(sliding_window=None)),
}

ARCHS = list(_SPECS)
"""The architectures of the tiny test models (every other type: tests/models/test_architectures.py)."""

_TOKENIZER = None


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level, one-token-per-character tokenizer: ids 0-3 are <pad> <s> </s> <unk>, then
    printable ASCII, space ('Ġ'), newline ('Ċ') and tab ('ĉ'); anything else is <unk>. Cached."""
    global _TOKENIZER
    if _TOKENIZER is None:
        table = {b: c for c, b in _byte_to_unicode_inverse().items()}
        chars = [table[b] for b in list(range(33, 127)) + [32, 10, 9]]
        vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
        assert len(vocab) <= VOCAB_SIZE
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                pre_tokenizers.Split(Regex("."), behavior="isolated"),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        _TOKENIZER = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
            padding_side="right",
        )
    return _TOKENIZER


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
"""A minimal chat template for the tiny tokenizer: each turn ``<s>role: content</s>`` (EOS closes it)."""


def tiny_chat_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh copy of :func:`tiny_tokenizer` with :data:`CHAT_TEMPLATE`."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _byte_to_unicode_inverse() -> dict[str, int]:
    from attngeom.model.handle import byte_decoder

    return byte_decoder()


def tiny_config(arch: str, **overrides):
    """The config for ``tiny_model(arch)`` (``overrides`` replace any field)."""
    if arch not in _SPECS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHS}")
    cls_name, specific = _SPECS[arch]
    kwargs = {**_COMMON, **specific, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def tiny_model(arch: str, seed: int = 0, attn_implementation: str | None = None, **overrides) -> ModelHandle:
    """A tiny random float32 eval-mode model of ``arch`` with the tiny tokenizer.

    Attention is "sdpa" except for Gemma2, whose softcapping SDPA cannot do ("eager").
    """
    config = tiny_config(arch, **overrides)
    if attn_implementation is None:
        attn_implementation = "eager" if arch == "gemma2" else "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=attn_implementation
    )
    model.eval()
    return ModelHandle(model=model, tokenizer=tiny_tokenizer(), spec=f"tiny-{arch}", name=f"tiny-{arch}")


def tiny_handles(seed: int = 0) -> dict[str, ModelHandle]:
    """One tiny model per supported architecture, keyed by architecture."""
    return {arch: tiny_model(arch, seed=seed) for arch in ARCHS}


def eager_attentions(handle, ids, hooks=()):
    """The attention maps ``[1, H, T, T]`` per layer of an eager forward pass of ``ids`` (the
    independent reference of tests), with forward ``hooks`` ``(module, fn)`` registered for the pass;
    the model's attention implementation is restored after."""
    eager = handle.model.config._attn_implementation
    handle.model.set_attn_implementation("eager")
    handles = [m.register_forward_hook(fn) for m, fn in hooks]
    try:
        with torch.no_grad():
            return handle.model(input_ids=torch.tensor([list(ids)]), output_attentions=True).attentions
    finally:
        handle.model.set_attn_implementation(eager)
        for x in handles:
            x.remove()
