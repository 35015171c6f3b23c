"""The papers' claims (SPEC §3–§6, docs/claims.md) measured on one model, with intervals and verdicts: the catalogue, its verdict rules
and rows (:mod:`.catalogue`), and the orchestration that runs the reduced experiments and resamples their
summaries (:mod:`.orchestration`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "HOLDS": "catalogue",
    "REFUTED": "catalogue",
    "INCONCLUSIVE": "catalogue",
    "MODERATE": "catalogue",
    "DEFAULTS": "catalogue",
    "CONTRIBUTION_PAPER": "catalogue",
    "SELECTION_PAPER": "catalogue",
    "CLAIMS": "catalogue",
    "CLAIM_BY_ID": "catalogue",
    "PAPER_ABBREVIATIONS": "catalogue",
    "catalogue_table": "catalogue",
    "verdict_side": "catalogue",
    "verdict_range": "catalogue",
    "verdict_all": "catalogue",
    "margin": "catalogue",
    "per_ratio_verdicts": "catalogue",
    "faithfulness_rows": "catalogue",
    "sink_rows": "catalogue",
    "selection_rows": "catalogue",
    "regime_rows": "catalogue",
    "removal_row": "catalogue",
    "early_critical_row": "catalogue",
    "claim_row": "catalogue",
    "fmt_num": "catalogue",
    "fmt_pct": "catalogue",
    "TOO_FEW": "catalogue",
    "sized": "catalogue",
    "experiment": "orchestration",
    "FIXED_REGIME_ORDER": "settings",
    "ClaimsSettings": "settings",
})
