"""Models the user already holds (``attngeom.wrap``: plain, peft LoRA active or merged, loaded with
``device_map``) and tiny GPT-2 / Pythia (gpt_neox) / OLMo checkpoints saved with ``save_pretrained``
and loaded back through ``load_model(DIR)`` and the CLI: the same numbers as the object in memory."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import attngeom
from attngeom.errors import ModelLoadError, UnsupportedArchitectureError
from tiny_models import tiny_model, tiny_tokenizer

TEXT = "The cat sat on the mat."
SMALL = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64,
             initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _model(model_type: str):
    cfg = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in SMALL.items()
                                                          if k in transformers.AutoConfig.for_model(model_type).to_dict()
                                                          or k in transformers.AutoConfig.for_model(model_type).attribute_map})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _numbers(handle) -> dict[str, np.ndarray]:
    trace = attngeom.analyze(handle, TEXT)
    return {f"{lt.index}.{m}": getattr(lt, m) for lt in trace.layers for m in ("attention", "contribution")}


def _same(a: dict, b: dict, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=1e-4, err_msg=k)


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "olmo"])
def test_saved_checkpoint_loads_with_the_same_numbers(model_type, tmp_path):
    model = _model(model_type)
    mem = attngeom.wrap(model, tiny_tokenizer())
    trace = attngeom.analyze(mem, TEXT)
    assert [lt.index for lt in trace.layers] == [0, 1]
    for lt in trace.layers:
        np.testing.assert_allclose(lt.contribution.sum(-1), 1.0, atol=1e-4)
    model.save_pretrained(tmp_path / model_type)
    tiny_tokenizer().save_pretrained(tmp_path / model_type)
    loaded = attngeom.load_model(str(tmp_path / model_type), device="cpu", progress=False)
    assert loaded.architecture == model_type
    _same(_numbers(mem), _numbers(loaded))
    heads = attngeom.stream(loaded, [TEXT], [attngeom.HeadStats()], progress=False)[0].result()
    assert len(heads) == 2 * 4 and np.isfinite(heads["sink_rate"]).all()


def test_cli_runs_a_saved_gpt2_and_refuses_bloom_with_exit_2(tmp_path):
    _model("gpt2").save_pretrained(tmp_path / "gpt2")
    tiny_tokenizer().save_pretrained(tmp_path / "gpt2")
    cli = [sys.executable, "-m", "attngeom", "analyze", "--text", TEXT, "--no-progress", "--device", "cpu"]
    ok = subprocess.run(cli + ["--model", str(tmp_path / "gpt2"), "--out", str(tmp_path / "out")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "out" / "heads.parquet").is_file()
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=128, n_layer=2, n_head=4, hidden_size=32))
    bloom.save_pretrained(tmp_path / "bloom")
    tiny_tokenizer().save_pretrained(tmp_path / "bloom")
    bad = subprocess.run(cli + ["--model", str(tmp_path / "bloom"), "--out", str(tmp_path / "out2")],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "bloom" in lines[0] and "attention interface" in lines[0], bad.stderr


def test_hub_ids_fail_in_one_line_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for spec in ("EleutherAI/pythia-160m", "openai-community/gpt2", "gpt2"):
        with pytest.raises(ModelLoadError) as info:
            attngeom.load_model(spec, device="cpu")
        assert spec in str(info.value) and "\n" not in str(info.value)


def test_device_map_model_wraps_with_the_same_numbers(tmp_path):
    model = _model("gpt2")
    model.save_pretrained(tmp_path / "m")
    mapped = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map="cpu")
    _same(_numbers(attngeom.wrap(model, tiny_tokenizer())), _numbers(attngeom.wrap(mapped, tiny_tokenizer())))
    handle = attngeom.load_model(mapped, tokenizer=tiny_tokenizer())
    assert handle.model is mapped and not mapped.training


def test_peft_lora_active_equals_merged():
    """With a LoRA adapter active, W_O is the adapted map (base + B·A·scale, read off the module);
    the numbers equal those of the merged model."""
    peft = pytest.importorskip("peft")
    base = tiny_model("llama").model
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(base, cfg).eval()
    active = attngeom.wrap(lora, tiny_tokenizer())
    ad = active.adapter
    o = lora.get_base_model().model.layers[0].self_attn.o_proj
    assert ad.o_proj(0) is o and ad.sites[0].out.kind == "affine"
    torch.testing.assert_close(ad.w_o(0), o.base_layer.weight + o.get_delta_weight("default"), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ids = torch.tensor([active.encode(TEXT)])
        plain = lora(input_ids=ids).logits
    numbers = _numbers(active)
    merged = attngeom.wrap(lora.merge_and_unload(), tiny_tokenizer())
    assert merged.adapter.sites[0].out.kind == "linear"
    _same(numbers, _numbers(merged), atol=1e-4)
    heads = attngeom.stream(merged, [TEXT], [attngeom.HeadStats()], progress=False)[0].result()
    assert np.isfinite(heads["head_share"]).all()
    assert plain.shape[-1] == 128


def test_wrap_refuses_what_it_cannot_capture():
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=128, n_layer=2, n_head=4, hidden_size=32))
    with pytest.raises(UnsupportedArchitectureError, match="bloom"):
        attngeom.wrap(bloom, tiny_tokenizer())
    with pytest.raises(ModelLoadError, match="tokenizer"):
        attngeom.load_model(bloom)
