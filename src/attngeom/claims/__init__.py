"""The papers' claims (SPEC §3–§6) measured on one model, with intervals and verdicts: :mod:`.catalogue` (docs/claims.md)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "CLAIMS": "catalogue",
    "CLAIM_BY_ID": "catalogue",
    "experiment": "catalogue",
    "ClaimsSettings": "settings",
})
