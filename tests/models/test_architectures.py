"""Every decoder-only causal-LM architecture of the installed transformers, tiny and random.

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a float32 model is built from its
configuration class (2 decoder layers, hidden 64, 4 heads, vocab 128: :func:`tiny_config`, with the
few per-type settings a config needs in :data:`TWEAKS`) and run on :data:`T` tokens. A type ends

* ``supported``: discovery (:mod:`attngeom.model.adapter`) establishes every attention layer and all
  checks pass: the input of the output projection that the model's own attention (SDPA or eager)
  computes is rebuilt from the captured blocks (``Σ_j a_ij^h v_j^h``); logits with analysis equal
  the model's own; ``Σ_j c_ij^h = 1`` and ``Σ_h Σ_j C_ij^h = 1``; attention rows sum to one (less the
  learned sink mass where there is one); a short ``stream`` with every reducer gives finite results;
* ``refused``: attngeom refuses it with one line (:class:`UnsupportedArchitectureError`), which the
  CLI prints with exit status 2;
* ``not tested``: no tiny model of the type is built here: a multimodal wrapper whose text model is a
  type of its own (tested as such), or a model that cannot run without another; the reason says which.
  A type whose tiny config fails validation, or whose own forward fails on it, is ``not tested`` too
  until :data:`TWEAKS` gives it the settings its config class requires.

A type that discovery accepts but whose numbers are wrong fails the test: nothing is silently wrong.
The matrix writes ``docs/architectures.md``; it fails when a type the committed table lists as
supported is no longer, or when fewer than :data:`MIN_SUPPORTED` types are supported.
"""

from __future__ import annotations

import re

import numpy as np
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from attngeom.capture.session import Session
from attngeom.errors import UnsupportedArchitectureError
from attngeom.model import ModelHandle
from attngeom.model.adapter import SUPPORTED_ARCHITECTURES, adapter_for, check_supported
from checks import RebuiltOutputs, o_proj_inputs as _o_proj_inputs

T = 12
DOC = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"
MIN_SUPPORTED = 108
REQUIRED = ("gpt2", "gpt_neox", "gptj", "opt", "olmo", "olmo2", "phi", "phi3", "stablelm", "starcoder2", "cohere",
            "granite", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "gpt_oss", "smollm3")
"""Types the project promises to support (docs/architectures.md)."""

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
             num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             n_shared_experts=1, shared_expert_intermediate_size=32, ffn_hidden_size=128, n_inner=128)
"""Sizes every config that has the field gets (a field the config lacks is not passed)."""

MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=24,
           num_key_value_heads=4, head_dim=8)
"""Multi-head latent attention: query/key heads of 16, value heads of 24 (they differ on purpose)."""

TINY_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
                   patch_size=16)
"""A vision encoder for the multimodal types whose text decoder has no model type of its own."""

TWEAKS: dict[str, dict] = {
    "deepseek_v2": MLA, "deepseek_v3": dict(MLA, first_k_dense_replace=1, n_group=1, topk_group=1),
    "glm4_moe_lite": MLA, "minicpm3": MLA, "sarvam_mla": MLA, "youtu": MLA, "longcat_flash": MLA,
    "kimi_linear": MLA, "axk2": MLA, "bailing_hybrid": MLA, "deepseek_v32": MLA, "glm_moe_dsa": MLA,
    "gptj": dict(rotary_dim=8), "codegen": dict(rotary_dim=8),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=8, mamba_expand=2, mamba_dt_rank=8),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128, mamba_d_state=8, mamba_chunk_size=16),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=8),
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0), d_model=64, n_heads=4, n_layers=2,
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2), max_seq_len=256),
    # cross-layer KV sharing: layers 2 and 3 reuse the keys and values of layers 0 and 1
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, intermediate_size=[128] * 4,
                         layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
                         altup_num_inputs=2, laurel_rank=8, hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=128),
    # MLA, and grouped expert routing with one group of the four experts (default 8 groups)
    "axk1": dict(MLA, n_group=1, topk_group=1),
    # MLA; validate_architecture: num_key_value_heads == num_attention_heads
    "dots3_note_text": MLA,
    # validate_architecture: hidden_size * expand == num_heads * head_dim (64 * 2 == 8 * 16)
    "mamba2": dict(num_heads=8),
    # validate_architecture: d_head == d_model // n_head (__post_init__ derives d_head before the aliases
    # hidden_size and num_attention_heads set d_model and n_head)
    "xlnet": dict(d_head=16),
    # validate_architecture: num_experts_per_tok == 1
    "zaya": dict(num_experts_per_tok=1),
    # validate_layer_type: one type per layer, set before __post_init__ derives the hybrid layer ids from it
    "zamba": dict(layers_block_type=["linear_attention", "hybrid"]),
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"]),
    # the rotary embedding reads rope_parameters per layer type (no default for a nested dict)
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0)}),
    # the indexed-attention layers build their QSA indexer from these (no defaults)
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=4),
    # the LM-head class asserts is_decoder; one local and one LSH layer, no axial positions (they need long inputs)
    "reformer": dict(is_decoder=True, attn_layers=["local", "lsh"], axial_pos_embds=False),
    # causal only as a decoder (as the LM-head class warns); the forward needs a language for its adapters
    # (what set_default_language sets)
    "xmod": dict(is_decoder=True, default_language="en_XX"),
    # byte-level: a patcher, local encoder and decoder and a global transformer, each tiny; the hash
    # embeddings' default vocabulary is 500002
    "blt": dict(encoder_hash_byte_group_vocab=128, **{f"{part}_config": dict(
        hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=1,
        **({"hidden_size_global": 64} if part in ("encoder", "decoder") else {}))
        for part in ("patcher", "encoder", "decoder", "global")}),
    # as in the real model (every fifth layer), a layer that attends to the image, skipped on text alone
    "mllama": dict(cross_attention_layers=[1]),
    # multimodal without a text type of its own: the text decoder is built, with tiny encoders
    "git": dict(vision_config=TINY_VISION),
    "phi4_multimodal": dict(vision_config=TINY_VISION, audio_config=dict(hidden_size=32, num_blocks=1,
                                                                        num_attention_heads=2, intermediate_size=64)),
}
"""Per-type settings a tiny config needs beyond :data:`SMALL`."""

ASSISTANT = ("speculative-decoding assistant: its forward needs the target model's input embeddings and KV states, "
             "not token ids")
NOT_BUILT = {
    "fuyu": "multimodal wrapper (its text model persimmon is tested on its own)",
    "gemma4_assistant": f"{ASSISTANT} (its text model gemma4_text is tested on its own)",
    "gemma4_unified_assistant": f"{ASSISTANT} (its text model gemma4_unified_text is tested on its own)",
}
"""Types whose tiny model this test does not build: a wrapper that the detection of multimodal
configs in :func:`tiny_config` does not recognise, or a model that cannot run without another."""


@dataclass
class Row:
    model_type: str
    status: str          # supported | refused | not tested
    reason: str
    seconds: float = 0.0


# --------------------------------------------------------------------------------------------
# Building a tiny model of a type
# --------------------------------------------------------------------------------------------


class NotBuilt(Exception):
    """No tiny model of this type can be built here."""


def _has(cfg, key: str) -> bool:
    return key in cfg.to_dict() or key in getattr(cfg, "attribute_map", {})


def tiny_config(model_type: str):
    from transformers import AutoConfig

    if model_type in NOT_BUILT:
        raise NotBuilt(NOT_BUILT[model_type])
    try:
        cfg0 = AutoConfig.for_model(model_type)
    except Exception as e:  # noqa: BLE001 - some default configs do not validate
        raise NotBuilt(f"default config: {_line(e)}") from None
    if getattr(cfg0, "is_encoder_decoder", False):
        return cfg0
    subs = set(getattr(cfg0, "sub_configs", {}) or {})
    text = getattr(cfg0, "text_config", None)
    if text is not None and subs & {"vision_config", "audio_config", "vq_config"}:
        if text.model_type in model_types():
            raise NotBuilt(f"multimodal wrapper (its text model {text.model_type} is tested on its own)")
        kw = dict(text_config=_tiny_kwargs(text, model_type))  # the type's causal LM is its text model (emu3, mllama)
    else:
        kw = _tiny_kwargs(cfg0, model_type)
    try:
        return AutoConfig.for_model(model_type, **kw)
    except Exception as e:  # noqa: BLE001 - config classes validate in many ways
        raise NotBuilt(f"tiny config: {_line(e)}") from None


def _tiny_kwargs(cfg0, model_type: str) -> dict:
    """The settings that make the default config ``cfg0`` tiny: :data:`SMALL`, :data:`TWEAKS`, two layer types."""
    kw = {k: v for k, v in SMALL.items() if _has(cfg0, k)}
    kw.update(TWEAKS.get(model_type, {}))
    layer_types = getattr(cfg0, "layer_types", None)
    if "layer_types" not in kw and isinstance(layer_types, list) and "layer_types" in cfg0.to_dict():
        kw["layer_types"] = _two_layer_types(layer_types)
    return kw


def _two_layer_types(types: list) -> list:
    """Two layer types from a default list, an attention layer last where there is one."""
    att = [x for x in types if "attention" in str(x) and "linear" not in str(x)]
    other = [x for x in types if x not in att]
    if att and other:
        return [other[0], att[0]]
    return list(types[:2]) * (2 // max(1, len(types[:2])))


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def build(model_type: str):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type)
    check_supported(cfg)
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        raise NotBuilt(f"tiny model: {_line(e)}") from None
    return model.eval()


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, min(vocab, 128), (1, T), generator=g)
    ids[0, 0] = 1
    return ids


# --------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------


class Checker(RebuiltOutputs):
    """Rebuilds each layer's output-projection input from the blocks and checks the sums (rows of
    heads whose output is zero left out of ``max_sum_c``) and each row's attention mass."""

    def __init__(self):
        super().__init__(T, live=1e-10)
        self.max_row_dev = 0.0
        self.sinks: dict[int, float] = {}

    def observe(self, block) -> None:
        super().observe(block)
        mass = block.a.sum(-1)                                      # with a learned sink: 1 - its share
        if block.learned_sink is not None:
            self.sinks[block.layer] = float(block.learned_sink.max())
            mass = mass + block.learned_sink
        self.max_row_dev = max(self.max_row_dev, float((mass - 1).abs().max()))


def _first_rows(seen: dict, out):
    """The first row of each layer's o_proj input (the matrix runs one text)."""
    return {layer: x[0] for layer, x in seen.items()}, out


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm().clamp_min(1e-12))


def own_forward(model) -> torch.Tensor:
    """The model's own logits on the test tokens (its own attention: SDPA or eager)."""
    with torch.no_grad():
        return model(_ids(model.config.get_text_config(decoder=True).vocab_size), use_cache=False).logits.float()


def check_model(model, model_type: str) -> str:
    """Run every check on a built model; returns the notes for the table (raises on failure)."""
    from attngeom.streaming import InputBatch, forward

    from tiny_models import tiny_tokenizer

    adapter = adapter_for(model)
    handle = ModelHandle(model=model, tokenizer=tiny_tokenizer(), spec=model_type, name=model_type)
    ids = _ids(model.config.get_text_config(decoder=True).vocab_size)
    own, ref = _first_rows(*_o_proj_inputs(adapter, lambda: own_forward(model), T))
    checker = Checker()
    session = Session(observers=[checker])
    batch = InputBatch(ids=ids, lengths=torch.tensor([T]), index=[0])
    under, got = _first_rows(*_o_proj_inputs(adapter, lambda: forward(handle, batch, session, logits=True), T))
    L = adapter.num_layers
    assert session.layers_seen == list(range(L)), session.layers_seen
    for l in range(L):
        assert _rel(checker.rebuilt[l], under[l].float()) < 1e-5, (model_type, l, "rebuilt under analysis")
        assert _rel(checker.rebuilt[l], own[l].float()) < 1e-4, (model_type, l, "rebuilt vs own attention")
    assert _rel(got, ref) < 1e-4, (model_type, "logits", _rel(got, ref))
    worst = dict(sum_c=checker.max_sum_c, sum_C=checker.max_sum_C, rows=checker.max_row_dev)
    assert checker.max_sum_c < 1e-3 and checker.max_sum_C < 1e-3, (model_type, worst)
    assert checker.max_row_dev < 1e-4, (model_type, worst)
    _stream_every_reducer(handle, ids)
    return _notes(adapter, checker)


def _stream_every_reducer(handle, ids) -> None:
    import numpy as np

    from attngeom.explorer.data import RowCollector
    from attngeom.streaming.reducers import FullCapture, HeadStats, TokenStats
    from attngeom.selection import SelectionStats
    from attngeom.sinks import SinkStats, SourceRemoval
    from attngeom.streaming import stream

    reducers = [HeadStats(), TokenStats(), FullCapture(), SinkStats(),
                SelectionStats(ns=(1, 2), repeats=2, max_lag=4), RowCollector(T, handle.num_heads, top_k=4)]
    stream(handle, [ids[0].tolist()], reducers, progress=False)
    removal = SourceRemoval(mode="sink")                       # the reducer that is an intervention
    stream(handle, [ids[0].tolist()], [], intervention=removal, progress=False)
    assert removal.calls > 0
    heads = reducers[0].result()
    assert len(heads) == handle.num_layers * handle.num_heads
    assert np.isfinite(heads[["sink_rate", "entropy", "head_share"]].to_numpy()).all()
    assert sorted(reducers[2].result()) == list(range(handle.num_layers))
    from attngeom.streaming.reducers import Reducer

    for r in reducers[1:]:
        if type(r).result is not Reducer.result:
            r.result()


def _notes(adapter, checker: Checker) -> str:
    g = adapter.geometry
    notes = []
    if adapter.hybrid:
        notes.append(f"hybrid: attention in decoder layers {adapter.decoder_index} of {len(adapter.decoder_layers)}")
    if g.num_kv_heads != g.num_heads:
        notes.append(f"{g.num_heads} query / {g.num_kv_heads} kv heads")
    if g.qk_head_dim != g.head_dim:
        notes.append(f"latent attention: q/k heads {g.qk_head_dim}, value heads {g.head_dim}")
    site = adapter.sites[0]
    if site.out.kind != "linear":
        notes.append(f"{site.out.name.rsplit('.', 1)[-1]}: {site.out.kind} weights")
    if adapter.b_o(0) is not None:
        notes.append("output-projection bias")
    if any(adapter.learned_sinks(l) for l in range(adapter.num_layers)):
        notes.append("learned sink logits")
    if any(adapter.sliding_window(l) for l in range(adapter.num_layers)):
        notes.append("sliding window")
    if site.value is None:
        notes.append("W_V not established (head taxonomy's weight norms unavailable)")
    elif site.value.rows is not None and site.value.rows != slice(0, g.num_kv_heads * g.head_dim):
        notes.append(f"fused {site.value.name.rsplit('.', 1)[-1]}")
    return "; ".join(notes)


# --------------------------------------------------------------------------------------------
# The matrix
# --------------------------------------------------------------------------------------------


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def check_type(model_type: str) -> Row:
    t0 = time.perf_counter()
    try:
        model = build(model_type)
        try:
            own_forward(model)
        except Exception as e:  # noqa: BLE001 - the model's own code, before attngeom does anything
            raise NotBuilt(f"the model's own forward fails on the tiny config: {_line(e)}") from None
        notes = check_model(model, model_type)
        row = Row(model_type, "supported", notes)
    except UnsupportedArchitectureError as e:
        assert "\n" not in str(e), (model_type, str(e))
        row = Row(model_type, "refused", str(e).split(": ", 1)[-1] if str(e).startswith(model_type) else str(e))
    except NotBuilt as e:
        row = Row(model_type, "not tested", str(e))
    row.seconds = time.perf_counter() - t0
    return row


def _committed_supported() -> set[str]:
    if not DOC.is_file():
        return set()
    return set(re.findall(r"^\| `([^`]+)` \| supported \|", DOC.read_text(encoding="utf-8"), flags=re.M))


def write_table(rows: list[Row]) -> None:
    import transformers

    counts = {s: sum(r.status == s for r in rows) for s in ("supported", "refused", "not tested")}
    lines = [
        "# Architectures",
        "",
        f"Generated by `tests/models/test_architectures.py` with transformers {transformers.__version__}: every "
        "`model_type` with a causal-LM class, built tiny and random (2 decoder layers, hidden 64, 4 heads) and run "
        "through attngeom. *supported*: the model's own attention output is rebuilt from the captured blocks, "
        "logits with analysis equal the model's own, `Σ_j c_ij^h = 1`, and a stream with every reducer runs. "
        "*refused*: attngeom refuses it with this one line (the CLI exits with status 2). *not tested*: no tiny "
        "model of the type is built (a wrapper whose text model is tested as a type of its own, or a model that "
        "cannot run without another).",
        "",
        f"**{counts['supported']} supported, {counts['refused']} refused, {counts['not tested']} not tested** "
        f"({len(rows)} types).",
        "",
        "| model type | status | reason / notes |",
        "|---|---|---|",
    ]
    for r in rows:
        reason = r.reason.replace("|", "\\|")
        lines.append(f"| `{r.model_type}` | {r.status} | {reason} |")
    DOC.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def matrix() -> dict[str, Row]:
    before = _committed_supported()
    rows = []
    with torch.no_grad():
        for t in model_types():
            rows.append(check_type(t))
    write_table(rows)
    out = {r.model_type: r for r in rows}
    out["__before__"] = before  # type: ignore[assignment]
    return out


def test_matrix(matrix):
    before = matrix.pop("__before__")
    supported = sorted(t for t, r in matrix.items() if r.status == "supported")
    lost = sorted(t for t in before if t in matrix and matrix[t].status != "supported")
    assert not lost, {t: matrix[t].reason for t in lost}
    missing = [t for t in REQUIRED if matrix[t].status != "supported"]
    assert not missing, {t: matrix[t].reason for t in missing}
    assert len(supported) >= MIN_SUPPORTED, (len(supported), supported)
    hybrids = [t for t in supported if matrix[t].reason.startswith("hybrid")]
    assert len(hybrids) >= 2, hybrids
    assert all(r.reason and "\n" not in r.reason for r in matrix.values() if r.status != "supported")
    for r in matrix.values():                          # a wrapper's text model said tested is a row of its own
        named = re.search(r"its text model (\S*) ?is tested on its own", r.reason)
        assert not named or named[1] in matrix, (r.model_type, r.reason)
    assert set(SUPPORTED_ARCHITECTURES) == set(supported), set(SUPPORTED_ARCHITECTURES) ^ set(supported)
    assert "bias" in matrix["doge"].reason                               # a per-head mask bias is refused
    assert "latent attention" in matrix["deepseek_v2"].reason            # value heads 24, q/k heads 16
    assert "learned sink logits" in matrix["gpt_oss"].reason
    assert matrix["gemma3n_text"].status == "supported"                  # cross-layer KV sharing
    assert "cross-attention" in matrix["blt"].reason                     # keys from another sequence are refused


# --------------------------------------------------------------------------------------------
# Semantics beyond the papers (docs/SPEC.md §1, "Architectures beyond the papers")
# --------------------------------------------------------------------------------------------


class _Blocks:
    def __init__(self, *names):
        self.names, self.seen = names, {}

    def observe(self, block) -> None:
        self.seen[block.layer] = {n: getattr(block, n) for n in self.names}
        self.seen[block.layer]["contribution"] = block.contribution
        self.seen[block.layer]["a"] = block.a


def test_output_projection_bias_is_added_once_and_belongs_to_no_source():
    """GPT-2: the c_proj output is ``o_i + b_O`` with ``o_i = Σ_h W_O^h o_i^h`` built from the blocks,
    and the contributions (defined on ``o_i``) sum to one."""
    from attngeom.streaming import InputBatch, forward
    from tiny_models import tiny_tokenizer

    model = build("gpt2")
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_proj.bias.normal_()                                # initialised to zero
    handle = ModelHandle(model=model, tokenizer=tiny_tokenizer(), spec="gpt2", name="gpt2")
    ad = handle.adapter
    outputs, hooks = {}, []
    for l in range(ad.num_layers):
        hooks.append(ad.o_proj(l).register_forward_hook(lambda m, a, y, l=l: outputs.__setitem__(l, y.detach()[0])))
    blocks = _Blocks("layer_output")
    try:
        forward(handle, InputBatch(ids=_ids(128), lengths=torch.tensor([T]), index=[0]), Session(observers=[blocks]))
    finally:
        for h in hooks:
            h.remove()
    for l in range(ad.num_layers):
        b = ad.b_o(l)
        assert b is not None and float(b.detach().abs().max()) > 0
        o = blocks.seen[l]["layer_output"][0]
        torch.testing.assert_close(o + b, outputs[l], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(blocks.seen[l]["contribution"].sum(-1), torch.ones(1, 4, T), rtol=0, atol=1e-4)


def test_learned_sinks_are_a_virtual_source_of_zero_value():
    """gpt-oss: the captured rows equal eager's weights over the real tokens, the learned sink takes
    the rest of each row, the entropy counts it as one more outcome, the sink rate includes it and
    the contributions of the real tokens still sum to one."""
    import numpy as np

    from attngeom.streaming.reducers import HeadStats
    from attngeom.streaming import InputBatch, forward, stream
    from tiny_models import tiny_tokenizer

    model = build("gpt_oss")
    model.set_attn_implementation("eager")
    ids = _ids(128)
    with torch.no_grad():
        eager = model(ids, output_attentions=True, use_cache=False).attentions      # [1, H, T, T] per layer
    handle = ModelHandle(model=model, tokenizer=tiny_tokenizer(), spec="gpt_oss", name="gpt_oss")
    blocks = _Blocks("learned_sink", "entropy")
    forward(handle, InputBatch(ids=ids, lengths=torch.tensor([T]), index=[0]), Session(observers=[blocks]))
    for l, ref in enumerate(eager):
        got = blocks.seen[l]
        torch.testing.assert_close(got["a"], ref.float(), rtol=1e-5, atol=1e-6)
        sink = got["learned_sink"]
        assert float(sink.min()) > 0
        torch.testing.assert_close(got["a"].sum(-1) + sink, torch.ones_like(sink), rtol=0, atol=1e-5)
        a = got["a"].double()
        expected = -(torch.special.xlogy(a, a)).sum(-1) - torch.special.xlogy(sink.double(), sink.double())
        torch.testing.assert_close(got["entropy"].double(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["contribution"].sum(-1), torch.ones_like(sink), rtol=0, atol=1e-4)
    stats = stream(handle, [ids[0].tolist()], [HeadStats(fields=("sink_rate",))], progress=False)[0].result()
    for l in range(len(eager)):
        a, sink = blocks.seen[l]["a"][0], blocks.seen[l]["learned_sink"][0]          # [H, T, T], [H, T]
        expected = (a[:, 1:, 0] + sink[:, 1:]).mean(-1).numpy()                      # queries i > 0
        np.testing.assert_allclose(stats[stats.layer == l].sort_values("head").sink_rate, expected, rtol=1e-5)


def test_hybrid_models_analyse_their_attention_layers_only():
    """Jamba with a Mamba layer then an attention layer: one attention layer, numbered 0, which is
    decoder layer 1; analysis sees exactly it and the logits are unchanged."""
    from attngeom.traces.trace import analyze
    from tiny_models import tiny_tokenizer

    model = build("jamba")
    handle = ModelHandle(model=model, tokenizer=tiny_tokenizer(), spec="jamba", name="jamba")
    ad = handle.adapter
    assert ad.hybrid and ad.num_layers == handle.num_layers == 1 and ad.decoder_index == [1]
    assert ad.decoder_layer(0) is model.model.layers[1]
    trace = analyze(handle, list(range(4, 4 + T)))
    assert [lt.index for lt in trace.layers] == [0]
    np.testing.assert_allclose(trace.layers[0].contribution.sum(-1), 1.0, atol=1e-4)


def test_learned_sinks_survive_a_saved_trace(tmp_path):
    """A gpt-oss trace keeps the learned sink's share of each row (rows over real tokens sum to
    1 − a_i∅), and saved with or without weights it reloads with the same maps and entropies."""
    from attngeom.traces.trace import Trace, analyze
    from tiny_models import tiny_tokenizer

    handle = ModelHandle(model=build("gpt_oss"), tokenizer=tiny_tokenizer(), spec="gpt_oss", name="gpt_oss")
    trace = analyze(handle, list(range(4, 4 + T)))
    for lt in trace.layers:
        sink = lt.learned_sink.numpy()
        assert sink.min() > 0
        np.testing.assert_allclose(lt.attention.sum(-1) + sink, 1.0, atol=1e-5)
    for weights in (False, True):
        back = Trace.load(trace.save(tmp_path / f"w{weights}", weights=weights))
        for lt, lb in zip(trace.layers, back.layers):
            np.testing.assert_allclose(lb.learned_sink.numpy(), lt.learned_sink.numpy())
            for name in ("contribution", "entropy"):
                np.testing.assert_allclose(getattr(lb, name), getattr(lt, name), rtol=1e-5, atol=1e-6)


def test_a_generation_trace_keeps_the_learned_sink(tmp_path):
    """A gpt-oss generation trace (step by step with the KV cache) keeps the learned sink's share of
    every row, equal to a full forward's of the same ids, and reloads from a saved trace."""
    from attngeom.traces.trace import Trace, analyze
    from tiny_models import tiny_tokenizer

    handle = ModelHandle(model=build("gpt_oss"), tokenizer=tiny_tokenizer(), spec="gpt_oss", name="gpt_oss")
    gen = analyze(handle, list(range(4, 10)), generate=3, stop=())
    full = analyze(handle, gen.ids)
    for lg, lf in zip(gen.layers, full.layers):
        np.testing.assert_allclose(lg.learned_sink.numpy(), lf.learned_sink.numpy(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(lg.attention.sum(-1) + lg.learned_sink.numpy(), 1.0, atol=1e-5)
    back = Trace.load(gen.save(tmp_path / "gen"))
    assert back.prompt_length == 6
    for lg, lb in zip(gen.layers, back.layers):
        np.testing.assert_allclose(lb.learned_sink.numpy(), lg.learned_sink.numpy())


def test_latent_attention_is_refused_before_any_stage_runs():
    """deepseek_v2 (multi-head latent attention) has no W_V: the head experiment refuses in one line
    before its taxonomy stages run (the weight-norm order needs ``‖W_V‖``)."""
    from attngeom.heads import experiment as HD
    from attngeom.heads.settings import HeadsSettings
    from attngeom.runs.run import InMemoryRun
    from tiny_models import tiny_tokenizer

    handle = ModelHandle(model=build("deepseek_v2"), tokenizer=tiny_tokenizer(), spec="deepseek_v2", name="deepseek_v2")
    stages = []

    class Counting(InMemoryRun):
        def stage(self, name, *args, **kw):
            stages.append(name)
            return super().stage(name, *args, **kw)

    windows = [[1] + [5 + 2 * i for i in range(24)]] * 3      # long enough to score: the refusal is the architecture's
    with pytest.raises(UnsupportedArchitectureError, match="W_V cannot be established") as err:
        HD.experiment(handle, Counting(), [windows], HeadsSettings(calib_windows=1, batch_size=1))
    assert stages == [] and "\n" not in str(err.value)
