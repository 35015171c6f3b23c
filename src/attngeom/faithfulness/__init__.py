"""Faithfulness of token rankings (SPEC §3): comprehensiveness and sufficiency curves (:mod:`.curves`) and multiple-choice tasks (:mod:`.tasks`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "build_variants": "curves",
    "variants_of": "curves",
    "window_units": "curves",
    "run_units": "curves",
    "ppl_table": "curves",
    "task_table": "curves",
    "summarize": "curves",
    "task_units": "curves",
    "summary": "curves",
    "experiment": "curves",
    "FaithfulnessSettings": "settings",
    "TASKS": "tasks",
    "load_task": "tasks",
    "accuracy": "tasks",
})
