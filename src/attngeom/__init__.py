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

from attngeom.errors import AttngeomError, InputError, ModelLoadError, OutputError, TraceFormatError, UnsupportedArchitectureError  # noqa: F401

_LAZY = {
    "ATTN_NAME": ".capture", "Block": ".capture", "Session": ".capture",
    "RankIntervention": ".capture", "HeadRemoval": ".capture", "SourceMask": ".capture",
    "DEFAULT_MODEL": ".model", "SUPPORTED_ARCHITECTURES": ".model", "ModelHandle": ".model", "load_model": ".model",
    "wrap": ".model",
    "InputBatch": ".streaming", "FullCapture": ".streaming", "HeadStats": ".streaming", "Reducer": ".streaming",
    "TokenStats": ".streaming",
    "head_effects": ".traces",
    "LayerTrace": ".traces", "Trace": ".traces", "analyze": ".traces", "analyze_batch": ".traces", "stream": ".streaming",
    "load_windows": ".data", "read_texts": ".data",
    "CompressedCache": ".kvcache",
}
"""Public name -> the package that defines it."""

SUBPACKAGES = ("analysis", "capture", "claims", "data", "explorer", "faithfulness", "generation", "heads", "kvcache", "metrics",
               "model", "runs", "selection", "sinks", "stats", "streaming", "traces")
"""The parts of attngeom (docs/design.md), reachable as attributes: ``attngeom.sinks.experiment``."""

__all__ = sorted([*_LAZY, *SUBPACKAGES, "AttngeomError", "InputError", "ModelLoadError", "OutputError", "TraceFormatError",
                  "UnsupportedArchitectureError", "__version__"])

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from attngeom import (analysis, capture, claims, data, explorer, faithfulness, generation, heads, kvcache, metrics, model,  # noqa: F401
                          runs, selection, sinks, stats, streaming, traces)  # noqa: F401
    from attngeom.capture import ATTN_NAME, Block, HeadRemoval, RankIntervention, Session, SourceMask  # noqa: F401
    from attngeom.data import load_windows, read_texts  # noqa: F401
    from attngeom.kvcache import CompressedCache  # noqa: F401
    from attngeom.model import DEFAULT_MODEL, SUPPORTED_ARCHITECTURES, ModelHandle, load_model, wrap  # noqa: F401
    from attngeom.streaming import FullCapture, InputBatch, HeadStats, Reducer, TokenStats, stream  # noqa: F401
    from attngeom.traces import LayerTrace, Trace, analyze, analyze_batch  # noqa: F401


def __getattr__(name: str):
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("attngeom")
        except PackageNotFoundError:  # pragma: no cover
            value = "0.0.0"
    elif name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        value = getattr(module, name)
    elif name in SUBPACKAGES:
        value = importlib.import_module(f".{name}", __name__)        # attngeom.sinks, attngeom.kvcache, ...
    else:
        raise AttributeError(f"module 'attngeom' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
