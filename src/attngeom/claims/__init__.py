"""The papers' claims measured on one model, with intervals and verdicts: the catalogue, its verdict rules
and rows (:mod:`.catalogue`), and the orchestration that runs the reduced experiments and resamples their
summaries (:mod:`.experiment`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "HOLDS": "catalogue",
    "REFUTED": "catalogue",
    "INCONCLUSIVE": "catalogue",
    "DEFAULTS": "catalogue",
    "CLAIMS": "catalogue",
    "CLAIM_BY_ID": "catalogue",
    "catalogue_table": "catalogue",
    "verdict_side": "catalogue",
    "verdict_range": "catalogue",
    "verdict_all": "catalogue",
    "per_ratio_verdicts": "catalogue",
    "claim_row": "catalogue",
    "TOO_FEW": "catalogue",
    "sized": "catalogue",
    "ClaimsSettings": "settings",
})
