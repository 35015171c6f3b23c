"""attngeom — geometry-aware analysis of attention in Hugging Face causal language models.

    from attngeom import load_model, analyze
    model = load_model("smollm2-135m")
    trace = analyze(model, "some text")
    trace.layers[5].contribution          # numpy float32 [heads, T, T]

The public names are imported on first use (PEP 562), so ``import attngeom`` and the command
line's ``--help`` do not import torch, transformers, pandas or matplotlib.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from .errors import AttngeomError, InputError, ModelLoadError, OutputError, TraceFormatError, UnsupportedArchitectureError

_LAZY = {
    "metrics": ".metrics",
    "ATTN_NAME": ".capture", "Block": ".capture", "Session": ".capture",
    "DEFAULT_MODEL": ".model", "SUPPORTED_ARCHITECTURES": ".model", "ModelHandle": ".model", "load_model": ".model",
    "wrap": ".model",
    "Batch": ".reducers", "FullCapture": ".reducers", "HeadStats": ".reducers", "Reducer": ".reducers",
    "TokenStats": ".reducers",
    "LayerTrace": ".trace", "Trace": ".trace", "analyze": ".trace", "analyze_batch": ".trace", "stream": ".trace",
}
"""Public name -> the module that defines it."""

__all__ = sorted([*_LAZY, "AttngeomError", "InputError", "ModelLoadError", "OutputError", "TraceFormatError",
                  "UnsupportedArchitectureError", "__version__"])

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from . import metrics
    from .capture import ATTN_NAME, Block, Session
    from .model import DEFAULT_MODEL, SUPPORTED_ARCHITECTURES, ModelHandle, load_model, wrap
    from .reducers import Batch, FullCapture, HeadStats, Reducer, TokenStats
    from .trace import LayerTrace, Trace, analyze, analyze_batch, stream


def __getattr__(name: str):
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("attngeom")
        except PackageNotFoundError:  # pragma: no cover
            value = "0.0.0"
    elif name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        value = module if name == "metrics" else getattr(module, name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)        # attngeom.trace, attngeom.data, ...
    else:
        raise AttributeError(f"module 'attngeom' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
