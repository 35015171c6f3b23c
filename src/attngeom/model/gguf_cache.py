"""GGUF files: dequantise them into float transformers models, and cache those as safetensors.

The first load of a GGUF file dequantises it (tens of seconds to a few minutes) and writes a float32
Hugging Face directory (config, ``model.safetensors``, tokenizer) under :func:`cache_dir`,
atomically; later loads read that directory in about a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import re
import shutil
import tempfile
import time

import torch

from attngeom.errors import ModelLoadError
from attngeom.model.adapter import attn_implementation_for, check_supported

SOURCE_MARKER = "attngeom_source.json"
"""File in a cache folder naming the GGUF it was made from."""


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


def first_line(e: BaseException) -> str:
    """First line of an exception's message, for a one-line error; where that line only introduces
    the reason on the next ("... validation error for validator 'x':"), the two lines joined."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    if not lines:
        return type(e).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


@contextlib.contextmanager
def quiet_progress(enabled: bool = True):
    """With ``enabled=False``, silence the progress bars transformers and huggingface_hub draw while
    loading ("Loading weights", GGUF dequantisation, downloads); restore their state afterwards."""
    if enabled:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    saved_tqdm = getattr(gguf_utils, "tqdm", None)
    try:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    except ImportError:  # pragma: no cover
        are_progress_bars_disabled = None
    hub_was_off = are_progress_bars_disabled() if are_progress_bars_disabled else True
    hf_logging.disable_progress_bar()
    if not hub_was_off:
        disable_progress_bars()
    if saved_tqdm is not None:  # the GGUF reader uses tqdm.auto directly, not transformers' switch
        gguf_utils.tqdm = _silent_tqdm(saved_tqdm)
    try:
        yield
    finally:
        if saved_tqdm is not None:
            gguf_utils.tqdm = saved_tqdm
        if not hub_was_off:
            enable_progress_bars()
        if was_on:
            hf_logging.enable_progress_bar()


def _silent_tqdm(tqdm_cls):
    def silent(*args, **kwargs):
        kwargs["disable"] = True
        return tqdm_cls(*args, **kwargs)
    return silent


def gguf_cache_path(path: pathlib.Path) -> pathlib.Path:
    """Cache folder for an arbitrary GGUF file, keyed by its resolved path, size and mtime."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:64]
    return cache_dir() / "gguf" / f"{stem}-{digest}"


def check_gguf_magic(path: pathlib.Path) -> None:
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


def has_weights(folder: pathlib.Path) -> bool:
    """Whether ``folder`` holds safetensors weights (one file or shards)."""
    return any(folder.glob("*.safetensors"))


def cache_complete(target: pathlib.Path) -> bool:
    """A cache folder is complete when it has config, weights and a tokenizer."""
    if not (target / "config.json").is_file():
        return False
    has_tok = (target / "tokenizer.json").is_file() or (target / "tokenizer_config.json").is_file()
    return has_weights(target) and has_tok


def dequantise_gguf(gguf: pathlib.Path, attn_implementation: str | None = None):
    """Read a GGUF file into a float32 transformers model and tokenizer (slow: tens of seconds)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf.parent), gguf.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{gguf} is not a GGUF model file transformers can read: {first_line(e)}") from e
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
            attn_implementation=attn_implementation_for(config, attn_implementation, False),
        )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load the model in {gguf}: {first_line(e)}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load the tokenizer in {gguf}: {first_line(e)}") from e
    clear_quantizer(model)
    return model, tokenizer


def clear_quantizer(model) -> None:
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


def cleanup_stale_temps(root: pathlib.Path, max_age_s: float = 6 * 3600) -> None:
    """Remove temp folders left by interrupted cache writes (older than ``max_age_s``)."""
    now = time.time()
    for tmp in root.glob(".*.tmp-*"):
        try:
            if tmp.is_dir() and now - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def save_cache(model, tokenizer, target: pathlib.Path, source: pathlib.Path,
               marker: dict | None = None) -> pathlib.Path | None:
    """Write the float model and tokenizer to ``target`` atomically (temp folder + rename).

    An interrupted write leaves only a hidden temp folder, never a half cache; when another
    process finished first, its cache is kept. ``marker`` adds fields to the source marker file.
    Returns ``target``, or None when transformers wrote no weights from this process: with
    ``torch.distributed`` initialised it saves checkpoints from rank 0 only, so the other ranks of a
    ``torchrun`` leave the cache to rank 0 (nothing renamed: a folder without weights must never
    become the cache) and use the model they hold, which that cache equals.
    """
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    cleanup_stale_temps(root)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        model.save_pretrained(tmp, safe_serialization=True)
        if not has_weights(tmp):
            return None                   # not transformers' saving rank (the temp folder is removed below)
        tokenizer.save_pretrained(tmp)
        st = source.stat()
        info = {"source": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, **(marker or {})}
        (tmp / SOURCE_MARKER).write_text(json.dumps(info, indent=2) + "\n")
        if target.exists():
            # A stale/incomplete cache (or one another process just wrote): replace only if unusable.
            if cache_complete(target):
                return target
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if cache_complete(target):  # lost a race with another process: fine
                return target
            raise
        return target
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
