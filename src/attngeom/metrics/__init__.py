"""Token-importance metrics of SPEC §2: the pure math (:mod:`.formulas`) and the one table every layer reads (:mod:`.registry`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "head_blocks": "formulas",
    "gram": "formulas",
    "value_weighted": "formulas",
    "output_normalized": "formulas",
    "head_output_norm": "formulas",
    "contribution": "formulas",
    "contribution_inter": "formulas",
    "contribution_factors": "formulas",
    "head_share": "formulas",
    "received": "formulas",
    "token_scores": "formulas",
    "entropy": "formulas",
    "QUANTITIES": "registry",
    "Metric": "registry",
    "METRICS": "registry",
    "register": "registry",
    "unregister": "registry",
    "get": "registry",
    "names": "registry",
    "hierarchy": "registry",
    "label": "registry",
})
