"""Head taxonomy and head removal (SPEC §6): :mod:`.taxonomy`, :mod:`.removal`."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "ORDERS": "removal",
    "removal_nll": "removal",
    "single_head_sensitivity": "removal",
    "taxonomy_order": "removal",
    "removed_at": "removal",
    "build_orders": "removal",
    "critical_heads": "removal",
    "removal_curves": "removal",
    "critical_z": "removal",
    "summary": "removal",
    "sensitivity_summary": "removal",
    "removal_summary": "removal",
    "calibration_perplexity": "removal",
    "experiment": "removal",
    "HeadsSettings": "settings",
    "REGIMES": "taxonomy",
    "TaxonomyStats": "taxonomy",
    "regimes_of": "taxonomy",
    "regime_shares": "taxonomy",
    "corpus_agreement": "taxonomy",
    "regime_alignment": "taxonomy",
})
