"""The capture engine: the attention plug-in (:mod:`.plugin`), and the interventions applied inside it (:mod:`.interventions`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "MODES": "interventions",
    "RANK_METRICS": "interventions",
    "Variant": "interventions",
    "CLEAN": "interventions",
    "masked_count": "interventions",
    "random_scores": "interventions",
    "order_keys": "interventions",
    "select_mask": "interventions",
    "RankIntervention": "interventions",
    "SourceMask": "interventions",
    "SOURCE_REMOVALS": "interventions",
    "control_columns": "interventions",
    "remove_source": "interventions",
    "HeadRemoval": "interventions",
    "ATTN_NAME": "plugin",
    "DEFAULT_BLOCK_ELEMENTS": "plugin",
    "MIN_BLOCK_QUERIES": "plugin",
    "LayerState": "plugin",
    "Block": "plugin",
    "Observer": "plugin",
    "Intervention": "plugin",
    "Workspace": "plugin",
    "GrowingTensor": "plugin",
    "Session": "plugin",
    "output_grams": "plugin",
    "exact_attention": "plugin",
    "attngeom_attention": "plugin",
    "attngeom_attention_implementation": "plugin",
})
