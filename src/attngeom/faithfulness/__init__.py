"""Faithfulness of token rankings (SPEC §3): comprehensiveness and sufficiency curves (:mod:`.curves`) and multiple-choice tasks (:mod:`.tasks`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "DEFAULT_RATIOS": "curves",
    "DEFAULT_SEEDS": "curves",
    "check_metrics": "curves",
    "check_ratios": "curves",
    "build_variants": "curves",
    "variants_of": "curves",
    "Unit": "curves",
    "window_units": "curves",
    "auto_rows": "curves",
    "run_units": "curves",
    "complete_units": "curves",
    "ppl_table": "curves",
    "task_table": "curves",
    "summarize": "curves",
    "TaskUnit": "curves",
    "task_units": "curves",
    "complete_examples": "curves",
    "summary": "curves",
    "experiment": "curves",
    "default_rankings": "settings",
    "FaithfulnessSettings": "settings",
    "TASKS": "tasks",
    "Example": "tasks",
    "load_task": "tasks",
    "OptionSequence": "tasks",
    "encode_options": "tasks",
    "accuracy": "tasks",
})
