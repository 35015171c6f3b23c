"""Head taxonomy and head removal (SPEC §6): :mod:`.taxonomy`, the removal orders and critical heads
(:mod:`.orders`), the experiment (:mod:`.experiment`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "ORDERS": "orders",
    "removal_nll": "experiment",
    "single_head_sensitivity": "experiment",
    "taxonomy_order": "orders",
    "removed_at": "orders",
    "build_orders": "orders",
    "critical_heads": "orders",
    "removal_curves": "experiment",
    "critical_z": "orders",
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
