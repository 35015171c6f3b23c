"""The papers' claims measured on one model, with intervals and verdicts: :mod:`.catalogue`."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "MODERATE": "catalogue",
    "DEFAULTS": "catalogue",
    "CONTRIBUTION_PAPER": "catalogue",
    "SELECTION_PAPER": "catalogue",
    "CLAIMS": "catalogue",
    "CLAIM_BY_ID": "catalogue",
    "verdict_side": "catalogue",
    "verdict_range": "catalogue",
    "verdict_all": "catalogue",
    "hist_quantile": "catalogue",
    "quadratic_vertex_interior": "catalogue",
    "faithfulness_stats": "catalogue",
    "margin": "catalogue",
    "per_ratio_verdicts": "catalogue",
    "sink_arrays": "catalogue",
    "sink_stats": "catalogue",
    "selection_arrays": "catalogue",
    "selection_stats": "catalogue",
    "winner_arrays": "catalogue",
    "regime_share_stats": "catalogue",
    "critical_z": "catalogue",
    "experiment": "catalogue",
    "FIXED_REGIME_ORDER": "settings",
    "ClaimsSettings": "settings",
})
