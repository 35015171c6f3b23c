"""attngeom — geometry-aware analysis of attention in Hugging Face causal language models.

    from attngeom import load_model, analyze
    model = load_model("smollm2-135m")
    trace = analyze(model, "some text")
    trace.layers[5].contribution          # numpy float32 [heads, T, T]
"""

from importlib.metadata import PackageNotFoundError, version as _version

from . import metrics
from .capture import ATTN_NAME, Block, Session
from .errors import AttngeomError, InputError, ModelLoadError, OutputError, UnsupportedArchitectureError
from .model import DEFAULT_MODEL, SUPPORTED_ARCHITECTURES, ModelHandle, load_model
from .reducers import Batch, FullCapture, HeadStats, Reducer, TokenStats
from .trace import LayerTrace, Trace, analyze, analyze_batch, stream

try:
    __version__ = _version("attngeom")
except PackageNotFoundError:  # pragma: no cover
    __version__ = "0.0.0"

__all__ = [
    "ATTN_NAME", "AttngeomError", "Batch", "Block", "DEFAULT_MODEL", "FullCapture", "HeadStats", "InputError",
    "LayerTrace", "ModelHandle", "ModelLoadError", "OutputError", "Reducer", "SUPPORTED_ARCHITECTURES",
    "Session", "TokenStats", "Trace", "UnsupportedArchitectureError", "analyze", "analyze_batch",
    "load_model", "metrics", "stream",
]
