"""Traces of one text: :func:`analyze` and :class:`Trace` (:mod:`.trace`), saved traces (:mod:`.saved`),
two traces compared (:mod:`.compare`), heads ranked by their effect on a token (:mod:`.effects`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "load_trace": "saved",
    "save_trace": "saved",
    "LayerTrace": "trace",
    "Trace": "trace",
    "analyze_batch": "trace",
    "analyze_generation": "trace",
    "analyze": "trace",
    "align": "compare",
    "diff": "compare",
    "TraceDiff": "compare",
    "compare_texts": "compare",
    "patch_heads": "compare",
    "head_effects": "effects",
    "predictions": "compare",
    "Layers": "trace",
    "MIN_ALIGNED": "compare",
})
