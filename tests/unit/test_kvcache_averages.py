"""RULER's average as kvpress computes it, and the floor marking the tasks that cannot
discriminate (attngeom.kvcache.averages), on a hand-made summary."""

import math

import pandas as pd

from attngeom.kvcache.averages import floor_table, ruler_average


def _summary():
    rows = [("a", "full", 0.0, 0.90), ("b", "full", 0.0, 0.05), ("c", "full", 0.0, 0.50),
            ("a", "snapkv", 0.5, 0.801234), ("b", "snapkv", 0.5, 0.0), ("c", "snapkv", 0.5, 0.25),
            ("all", "full", 0.0, 0.4833), ("all", "snapkv", 0.5, 0.35)]        # over-all rows are ignored
    return pd.DataFrame(rows, columns=["task", "policy", "ratio", "accuracy"])


def test_floor_marks_tasks_the_full_cache_fails():
    t = floor_table(_summary(), floor=0.10)
    assert t["task"].tolist() == ["a", "b", "c"] and t["discriminates"].tolist() == [True, False, True]
    assert floor_table(_summary(), floor=0.6)["discriminates"].tolist() == [True, False, False]


def test_average_is_kvpress_mean_of_rounded_task_scores_with_and_without_the_floor():
    avg = ruler_average(_summary(), floor=0.10).set_index("policy")
    # snapkv: tasks 80.12 (80.1234 rounded), 0, 25 -> 35.04; without b: (80.12 + 25) / 2 = 52.56
    assert math.isclose(avg.loc["snapkv", "average"], (80.12 + 0 + 25) / 3)
    assert math.isclose(avg.loc["snapkv", "average_discriminating"], (80.12 + 25) / 2)
    assert avg.loc["snapkv", "tasks"] == 3 and avg.loc["snapkv", "discriminating_tasks"] == 2
    assert math.isclose(avg.loc["full", "average"], (90 + 5 + 50) / 3)
    none = ruler_average(_summary(), floor=0.95).set_index("policy")
    assert math.isnan(none.loc["snapkv", "average_discriminating"]) and none.loc["snapkv", "discriminating_tasks"] == 0
