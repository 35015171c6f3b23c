"""Head taxonomy and head removal (SPEC §6): :mod:`.taxonomy`, :mod:`.removal`."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "ORDERS": "experiment",
    "removal_nll": "experiment",
    "single_head_sensitivity": "experiment",
    "taxonomy_order": "experiment",
    "removed_at": "experiment",
    "build_orders": "experiment",
    "critical_heads": "experiment",
    "removal_curves": "experiment",
    "critical_z": "experiment",
    "resampled": "experiment",
    "resampled_sensitivity": "experiment",
    "resampled_removal": "experiment",
    "calibration_perplexity": "experiment",
    "HeadsSettings": "settings",
    "REGIMES": "taxonomy",
    "TaxonomyStats": "taxonomy",
    "regimes_of": "taxonomy",
    "regime_shares": "taxonomy",
    "corpus_agreement": "taxonomy",
    "regime_alignment": "taxonomy",
})
