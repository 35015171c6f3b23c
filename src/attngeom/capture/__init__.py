"""The capture engine: the session and the switch onto the attention plug-in (:mod:`.session`), the
blocked exact attention kernel (:mod:`.kernel`), the blocks observers and interventions see
(:mod:`.blocks`), and the interventions applied inside it (:mod:`.interventions`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "Variant": "interventions",
    "CLEAN": "interventions",
    "RankIntervention": "interventions",
    "SourceMask": "interventions",
    "HeadRemoval": "interventions",
    "ATTN_NAME": "session",
    "LayerState": "blocks",
    "Block": "blocks",
    "Observer": "blocks",
    "Intervention": "blocks",
    "Workspace": "kernel",
    "GrowingTensor": "kernel",
    "Session": "session",
    "exact_attention": "kernel",
})
