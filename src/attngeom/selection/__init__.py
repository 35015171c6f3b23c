"""Geometry of token selection (SPEC §5): precision / recall / F of top-N selections (:mod:`.separation`), the
sink-aware prediction (:mod:`.prediction`), one query and the corpus reducer (:mod:`.reducer`), the experiment and its
summaries (:mod:`.experiment`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "DISTANCES": "settings",
    "SelectionSettings": "settings",
    "SELECTION_KINDS": "separation",
    "default_ns": "separation",
    "topn_order": "separation",
    "random_orders": "separation",
    "scores": "separation",
    "COMPARE_ELEMENTS": "separation",
    "GEOMETRY_ELEMENTS": "separation",
    "geometry": "separation",
    "geometry_from_gram": "separation",
    "bound_violations": "separation",
    "violated_bounds": "separation",
    "default_lags": "prediction",
    "lag_cosines": "prediction",
    "sink_regime": "prediction",
    "model_gram": "prediction",
    "predict_curves": "prediction",
    "best_small_n": "prediction",
    "analyse_query": "reducer",
    "query_geometry": "reducer",
    "on_host": "reducer",
    "QueryGeometry": "reducer",
    "SelectionStats": "reducer",
    "best_small_n_table": "experiment",
    "summarize": "experiment",
    "resampled": "experiment",
})
