"""The capture engine: the attention plug-in (:mod:`.plugin`), and the interventions applied inside it (:mod:`.interventions`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "Variant": "interventions",
    "CLEAN": "interventions",
    "RankIntervention": "interventions",
    "SourceMask": "interventions",
    "HeadRemoval": "interventions",
    "ATTN_NAME": "plugin",
    "LayerState": "plugin",
    "Block": "plugin",
    "Observer": "plugin",
    "Intervention": "plugin",
    "Workspace": "plugin",
    "GrowingTensor": "plugin",
    "Session": "plugin",
    "exact_attention": "plugin",
})
