"""Geometry of token selection (SPEC §5): :mod:`.topn`."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "SelectionSettings": "settings",
    "KINDS": "topn",
    "topn_order": "topn",
    "random_orders": "topn",
    "scores": "topn",
    "geometry": "topn",
    "bound_violations": "topn",
    "sink_regime": "topn",
    "predict_curves": "topn",
    "best_small_n": "topn",
    "SelectionStats": "topn",
    "summarize": "topn",
    "experiment": "topn",
})
