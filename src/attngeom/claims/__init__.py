"""The papers' claims measured on one model, with intervals and verdicts: :mod:`.catalogue`."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "CLAIMS": "catalogue",
    "CLAIM_BY_ID": "catalogue",
    "experiment": "catalogue",
    "ClaimsSettings": "settings",
})
