"""Device and dtype policy, cheap to call before anything is loaded (imports torch only).

* :func:`resolve_device` (alias :func:`check_device`): ``None``/``"auto"`` is cuda when a GPU is
  present, else cpu; ``"cuda"``/``"cuda:N"``/``"mps"`` that this machine lacks raise
  :class:`~attngeom.errors.InputError` with one line, so commands can check ``--device`` first.
* :func:`resolve_dtype`: ``None`` is float32 on CPU (and MPS), bfloat16 on CUDA (float16 where
  bfloat16 is unsupported); names are normalised, so an explicit ``"float32"`` on CPU is the same
  value as the default.
"""

from __future__ import annotations

import torch

from attngeom.errors import InputError

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
"""Accepted dtype names (also with a ``torch.`` prefix) and ``"auto"`` (the checkpoint's own)."""

_DEVICE_HINT = "use 'cpu', 'cuda', 'cuda:N' or 'mps'"


def resolve_device(spec=None) -> torch.device:
    """The torch.device for ``spec`` (None, "auto", a string or a torch.device), checked against
    this machine: raises InputError (one line) for an unknown name, CUDA without a GPU, ``cuda:N``
    beyond the GPU count, or MPS where it is absent. Plain ``"cuda"`` becomes the current GPU,
    ``cuda:K``."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "auto")):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = f"cuda:{spec}"
    try:
        device = spec if isinstance(spec, torch.device) else torch.device(str(spec).strip())
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"unknown device {spec!r}; {_DEVICE_HINT}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise InputError(f"device {str(device)!r} is not available: torch sees no CUDA GPU "
                             f"(torch {torch.__version__}, {build}); use device 'cpu'")
        count = torch.cuda.device_count()
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if device.index >= count:
            raise InputError(f"device {str(device)!r} does not exist: this machine has {count} CUDA "
                             f"GPU{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1})")
        return device
    if device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise InputError(f"device {str(device)!r} is not available: this machine has no MPS (Apple GPU); "
                             "use device 'cpu'")
        return device
    if device.type == "cpu":
        return torch.device("cpu")
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise InputError(f"device {str(device)!r} is not available on this machine; {_DEVICE_HINT}")
    return device


check_device = resolve_device
"""Alias: commands call ``check_device(args.device)`` before loading anything."""


def resolve_dtype(dtype=None, device=None):
    """The torch.dtype to load weights in (or ``"auto"``): ``dtype`` by name or as a torch.dtype,
    else float32 on CPU/MPS and bfloat16 on CUDA (float16 where bf16 is unsupported). ``device`` is
    anything :func:`resolve_device` accepts. Raises InputError for an unknown name."""
    if dtype is None or (isinstance(dtype, str) and not dtype.strip()):
        device = resolve_device(device)
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise InputError(f"dtype {dtype} is not a floating point type; use 'float32', 'bfloat16' or 'float16'")
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key == "auto":
            return "auto"
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
    raise InputError(f"unknown dtype {dtype!r}; use one of 'float32', 'bfloat16', 'float16' or 'auto'")


def dtype_name(dtype) -> str:
    """``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"`` for a resolved dtype."""
    return str(dtype).removeprefix("torch.")
