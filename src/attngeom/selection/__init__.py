"""Geometry of token selection (SPEC §5): precision / recall / F of top-N selections (:mod:`.separation`), the
sink-aware prediction (:mod:`.prediction`), one query and the corpus reducer (:mod:`.reducer`), the experiment and its
summaries (:mod:`.corpus`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "SelectionSettings": "settings",
    "KINDS": "separation",
    "EPS": "separation",
    "default_ns": "separation",
    "check_ns": "separation",
    "topn_order": "separation",
    "random_orders": "separation",
    "ranks_of": "separation",
    "scores": "separation",
    "COMPARE_MAX_N": "separation",
    "COMPARE_ELEMENTS": "separation",
    "GEOMETRY_ELEMENTS": "separation",
    "geometry": "separation",
    "geometry_from_rows": "separation",
    "geometry_from_gram": "separation",
    "bound_violations": "separation",
    "default_lags": "prediction",
    "LAMBDA_GRID": "prediction",
    "fit_exp_decay": "prediction",
    "attention_profile": "prediction",
    "lag_cosines": "prediction",
    "sink_regime": "prediction",
    "model_parts": "prediction",
    "model_rows": "prediction",
    "model_gram": "prediction",
    "predict_curves": "prediction",
    "best_small_n": "prediction",
    "QueryResult": "reducer",
    "analyse_query": "reducer",
    "SelectionStats": "reducer",
    "best_small_n_table": "corpus",
    "summarize": "corpus",
    "summary_sums": "corpus",
    "summary": "corpus",
    "experiment": "corpus",
})
