"""The interactive explorer's data (:mod:`.data`): flows, top sources and head tables from a trace; its HTML is
:mod:`attngeom.reports.explore`."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "DEFAULT_TOP_K": "data",
    "DEFAULT_EXACT_MAX_TOKENS": "data",
    "METRICS": "data",
    "HEAD_STATS": "data",
    "PAD": "data",
    "RESIDUAL_DECIMALS": "data",
    "TOPK_MANTISSA_BITS": "data",
    "ExploreData": "data",
    "flow": "data",
    "flow_edges": "data",
    "round_float16": "data",
    "RowCollector": "data",
    "ResidualShares": "data",
    "resolve_mode": "data",
    "build": "data",
    "from_trace": "data",
    "ExploreSettings": "settings",
})
