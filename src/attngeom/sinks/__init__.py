"""Attention sinks as active suppressors (SPEC §4): :mod:`.suppression`."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "SinksSettings": "settings",
    "rho_star": "suppression",
    "counterfactual_norm": "suppression",
    "variance_shares": "suppression",
    "histogram_counts": "suppression",
    "histogram_quantile": "suppression",
    "quadratic_fit": "suppression",
    "SinkValues": "suppression",
    "SinkQueries": "suppression",
    "SinkDrift": "suppression",
    "SinkDecomposition": "suppression",
    "SinkStats": "suppression",
    "SourceRemoval": "suppression",
    "summarize": "suppression",
    "experiment": "suppression",
})
