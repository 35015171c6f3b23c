"""Faithfulness of token rankings (SPEC §3): comprehensiveness and sufficiency curves (:mod:`.experiment`) and multiple-choice tasks (:mod:`.tasks`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "build_variants": "experiment",
    "variants_of": "experiment",
    "window_units": "experiment",
    "run_units": "experiment",
    "ppl_table": "experiment",
    "task_table": "experiment",
    "summarize": "experiment",
    "task_units": "experiment",
    "resampled": "experiment",
    "FaithfulnessSettings": "settings",
    "TASKS": "tasks",
    "load_task": "tasks",
    "accuracy": "tasks",
})
