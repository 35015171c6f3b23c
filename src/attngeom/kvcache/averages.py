"""Averages over RULER's tasks as kvpress reports them, and the tasks that cannot discriminate.

kvpress's RULER score of a run (``evaluation/benchmarks/ruler/calculate_metrics.py``) is, per task,
``string_match_all`` averaged over the task's examples, times 100 and rounded to two decimals; its
leaderboard averages those task scores, each task weighing the same. A task whose **full-cache**
accuracy is below a floor cannot tell policies apart (the model fails it whatever is kept:
``common_words`` and ``variable_tracking`` score 1–9 % with the full cache in every published run
of the bundled 4-bit SmolLM2), yet it weighs as much as the others; :func:`ruler_average` gives the
average with and without such tasks, and :func:`floor_table` says which they are.

Input: a summary table of :func:`attngeom.kvcache.tasks.summarize` (``task, policy, ratio,
accuracy``; the full cache as ``policy = full, ratio = 0``; rows over all tasks are ignored).
"""

from __future__ import annotations

import pandas as pd

FLOOR = 0.10
"""The full-cache accuracy (0–1) below which a task is marked as not discriminating."""


def _per_task(summary: pd.DataFrame) -> pd.DataFrame:
    from attngeom.kvcache.tasks import ALL_TASKS

    return summary[summary["task"] != ALL_TASKS]


def floor_table(summary: pd.DataFrame, floor: float = FLOOR) -> pd.DataFrame:
    """One row per task: ``full_accuracy`` (the full cache's, 0–1) and ``discriminates``
    (``full_accuracy >= floor``)."""
    full = _per_task(summary)
    full = full[full["policy"] == "full"][["task", "accuracy"]].rename(columns={"accuracy": "full_accuracy"})
    full = full.drop_duplicates("task").sort_values("task").reset_index(drop=True)
    full["discriminates"] = full["full_accuracy"] >= floor
    return full


def ruler_average(summary: pd.DataFrame, floor: float = FLOOR) -> pd.DataFrame:
    """Per (policy, ratio): ``average`` (kvpress's: each task's accuracy × 100 rounded to two
    decimals, then their mean, each task weighing the same), ``average_discriminating`` (the same
    over the tasks :func:`floor_table` keeps; NaN when none is kept), and the ``tasks`` and
    ``discriminating_tasks`` counted. A (policy, ratio) that lacks a task is averaged over the
    tasks it has."""
    rows = _per_task(summary)
    keep = set(floor_table(summary, floor).query("discriminates")["task"])
    out = []
    for (policy, ratio), g in rows.groupby(["policy", "ratio"], sort=True):
        scores = (g.set_index("task")["accuracy"] * 100).round(2)
        kept = scores[scores.index.isin(keep)]
        out.append({"policy": policy, "ratio": float(ratio), "average": float(scores.mean()),
                    "average_discriminating": float(kept.mean()) if len(kept) else float("nan"),
                    "tasks": int(len(scores)), "discriminating_tasks": int(len(kept))})
    return pd.DataFrame(out)


def record(summary: pd.DataFrame, floor: float = FLOOR) -> dict:
    """What a kvtasks ``summary.json`` records of the floor and the averages (``ruler_average``):
    the ``floor``, each task's ``full_accuracy``, the tasks ``below_floor``, and ``averages``, the
    rows of :func:`ruler_average` (NaN as ``None``). The tables and the report read them from here."""
    table = floor_table(summary, floor)
    rows = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()}
            for r in ruler_average(summary, floor).to_dict(orient="records")]
    return {"floor": floor, "full_accuracy": {str(t): float(a) for t, a in zip(table["task"], table["full_accuracy"])},
            "below_floor": [str(t) for t, keep in zip(table["task"], table["discriminates"]) if not keep],
            "averages": rows}


def from_results(results: list[dict], floor: float = FLOOR) -> dict:
    """:func:`record` of a ``summary.json``'s ``results`` rows (a run written before the field existed
    has them too)."""
    return record(pd.DataFrame(results, columns=["task", "policy", "ratio", "accuracy"]), floor)


def said(rec: dict) -> str:
    """The tasks below the floor in words: ``"common_words (1.3 %), variable_tracking (8.7 %)"`` or ``"none"``."""
    return ", ".join(f"{t} ({100 * rec['full_accuracy'][t]:.1f} %)" for t in rec["below_floor"]) or "none"

