"""Statistics shared by the analyses: the seeded bootstrap over windows (:mod:`.resampling`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "MIN_UNITS": "resampling",
    "resample_counts": "resampling",
    "resample_sums": "resampling",
    "ratio_of_sums": "resampling",
    "resampled_perplexity": "resampling",
    "percentile_interval": "resampling",
    "bootstrap": "resampling",
})
