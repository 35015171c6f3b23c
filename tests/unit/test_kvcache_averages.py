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


def test_record_is_what_summary_json_keeps_and_reads_the_same_from_its_rows():
    from attngeom.kvcache.averages import from_results, record, said

    rec = record(_summary(), floor=0.10)
    assert rec["floor"] == 0.10 and rec["below_floor"] == ["b"] and rec["full_accuracy"] == {"a": 0.9, "b": 0.05, "c": 0.5}
    by = {(r["policy"], r["ratio"]): r for r in rec["averages"]}
    assert math.isclose(by[("snapkv", 0.5)]["average_discriminating"], (80.12 + 25) / 2)
    assert from_results(_summary().to_dict(orient="records"), floor=0.10) == rec      # a summary.json's rows
    assert said(rec) == "b (5.0 %)"
    none = record(_summary(), floor=0.95)
    assert all(r["average_discriminating"] is None for r in none["averages"])             # JSON null, not NaN
    assert said(record(_summary(), floor=0.01)) == "none"


def test_the_tables_and_the_report_mark_the_floor_and_give_both_averages():
    """tools/kvtasks_tables.py marks a task below the floor with † in the per-task tables and prints
    kvpress's average over all tasks / without it; the command's report says the same lines."""
    from pathlib import Path

    from checks import load_script

    from attngeom.kvcache.averages import record
    from attngeom.kvcache.experiment import task_headline

    tables = load_script(Path(__file__).resolve().parents[2] / "tools" / "kvtasks_tables.py")
    rows = _summary().assign(low=None, high=None).to_dict(orient="records")
    s = {"tasks": ["a", "b", "c"], "policies": ["snapkv"], "results": rows}
    assert tables.task_table(s, 0.5).splitlines()[0] == "| policy | a | b† | c | all |"
    assert tables.floor_said(s).endswith("cannot tell policies apart: b (5.0 %).")
    avg = tables.average_table(s).splitlines()
    assert avg[2] == "| full cache | 48.33 / 70.00 |"                        # (90 + 5 + 50) / 3; (90 + 50) / 2
    assert avg[3] == "| snapkv | 35.04 / 52.56 |"
    assert "over all 3 tasks / over the 2 at or above the floor" in tables.average_heading(s)
    summary = {"examples": 12, "tasks": ["a", "b", "c"], "mode": "question-agnostic", "chat_template": False,
               "results": rows, "verdicts": [], "ruler_average": record(_summary())}
    lines = dict(task_headline(summary))
    assert lines["tasks below the floor (full-cache accuracy under 10 %: they cannot tell policies apart)"] == "b (5.0 %)"
    assert lines["RULER average as kvpress computes it, snapkv at ratio 0.5"] == "35.04 over 3 tasks; 52.56 over the 2 at or above the floor"


def test_the_figure_names_the_tasks_below_the_floor():
    from attngeom.reports.kvtasks import below_floor

    assert below_floor(_summary(), 0.10, floor_table) == "Below the floor (full cache < 10 %), counted in all tasks: b."
    assert below_floor(_summary(), 0.01, floor_table) == "No task below the floor (full cache < 1 %)."
