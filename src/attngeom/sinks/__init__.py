"""Attention sinks as active suppressors (SPEC §4): the pure math (:mod:`.geometry`), the corpus reducer
(:mod:`.reducer`), sink removal (:mod:`.removal`), the experiment and its summary (:mod:`.experiment`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "SinksSettings": "settings",
    "HISTOGRAMS": "reducer",
    "rho_star": "geometry",
    "counterfactual_norm": "geometry",
    "sink_terms": "geometry",
    "pair_factors": "geometry",
    "log_share_sums": "geometry",
    "variance_shares": "geometry",
    "histogram_counts": "geometry",
    "histogram_quantile": "geometry",
    "quadratic_fit": "geometry",
    "quadratic_fit_shape": "geometry",
    "SinkValues": "reducer",
    "SinkQueries": "reducer",
    "SinkDrift": "reducer",
    "SinkDecomposition": "reducer",
    "SinkStats": "reducer",
    "SourceRemoval": "removal",
    "window_work": "experiment",
    "results_from": "experiment",
    "summarize": "experiment",
    "resampled": "experiment",
})
