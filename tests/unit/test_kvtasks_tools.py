"""tools/kvtasks_merge.py and tools/kvtasks_tables.py on hand-made runs: only whole tasks are
merged, their examples add up across runs (``--first-example``) and folders the tool wrote, an
example is taken from the first input that has it, inputs of other settings are refused, and the
tables show what the summary says."""

import json
from pathlib import Path

import pandas as pd

from checks import load_script

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _tool(name):
    return load_script(TOOLS / f"{name}.py")


SETTINGS = {"model": "m", "dtype": "float32", "device_type": "cpu", "threads": 1, "length": 64, "examples": 2,
            "seed": 0, "haystack": "noise", "policies": ["random", "contribution"], "ratios": [0.5],
            "mode": "question-agnostic", "chat": None}


def _rows(task, examples, scores):
    """Rows of ``examples`` of ``task``: the full cache and each policy at ratio 0.5, ``scores[policy]``."""
    out = []
    for e in examples:
        for policy, ratio in (("full", 0.0), ("random", 0.5), ("contribution", 0.5)):
            out.append({"example": e, "task": task, "mode": "question-agnostic", "chat": False, "policy": policy,
                        "ratio": ratio, "answer": "", "score": scores[policy][e], "answer_tokens": 1, "kept": 1,
                        "bytes": 1.0, "seconds": 0.1, "kept_share": 1.0 if policy == "full" else 0.5,
                        "prefill_seconds": 0.1})
    return pd.DataFrame(out)


def _run(path: Path, tasks, rows: pd.DataFrame, finished: bool, jsonl=None, **settings) -> Path:
    """A real attngeom kvtasks run of ``rows`` in ``path`` (:class:`attngeom.runs.run.Run`: its sealed
    settings, one checkpoint unit per example), finished (``answers.parquet``, ``examples.jsonl`` when
    ``jsonl`` gives its examples, and the sealed ``run.json``) or stopped (its units only, the last line cut
    short by a kill)."""
    from attngeom.kvcache import ruler
    from attngeom.runs.run import Run

    groups = [g.reset_index(drop=True) for _, g in rows.groupby(["task", "example"])]
    run = Run(path, "kvtasks", {**SETTINGS, "tasks": tasks, **settings}, progress=False)
    run.stage("tasks", len(groups), lambda units: {"rows": pd.concat([groups[u] for u in units], ignore_index=True)})
    if finished:
        def write(staging):
            rows.to_parquet(staging / "answers.parquet")
            if jsonl is not None:
                ruler.write_jsonl(jsonl, staging / "examples.jsonl")
            return ["answers.parquet"] + (["examples.jsonl"] if jsonl is not None else [])

        run.finish(write)
    else:                                                   # a stopped run: its units in the checkpoint
        run.close()
        with next((path / "checkpoint").glob("records-*.jsonl")).open("a") as f:
            f.write('{"stage": "tasks", "units": [9')       # a line cut short by a kill
    return path


def test_merge_takes_whole_tasks_first_run_first_and_refuses_other_settings(tmp_path, capsys):
    merge = _tool("kvtasks_merge")
    full = {0: 1.0, 1: 1.0}
    a = _run(tmp_path / "a", ["t1", "t2"], pd.concat([
        _rows("t1", [0, 1], {"full": full, "random": {0: 0.0, 1: 0.0}, "contribution": {0: 1.0, 1: 0.0}}),
        _rows("t2", [0], {"full": full, "random": {0: 1.0}, "contribution": {0: 1.0}})]), finished=False)
    b = _run(tmp_path / "b", ["t2", "t1"], pd.concat([
        _rows("t2", [0, 1], {"full": full, "random": {0: 1.0, 1: 1.0}, "contribution": {0: 0.0, 1: 1.0}}),
        _rows("t1", [0, 1], {"full": full, "random": {0: 1.0, 1: 1.0}, "contribution": {0: 1.0, 1: 1.0}})]),
        finished=True)
    out = tmp_path / "merged"
    assert merge.main(["--out", str(out), str(a), str(b)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["merged"] == [{"run": "a", "tasks": ["t1"], "examples": {"t1": "0-1"}},
                           {"run": "b", "tasks": ["t2"], "examples": {"t2": "0-1"}, "skipped": {"t1": "0-1"}}]
    assert s["tasks"] == ["t1", "t2"] and s["examples"] == 4 and s["examples_per_task"] == {"t1": 2, "t2": 2}
    acc = {(r["task"], r["policy"]): r["accuracy"] for r in s["results"]}
    assert acc[("t1", "contribution")] == 0.5 and acc[("t1", "random")] == 0.0      # t1 from run a, not b
    assert acc[("t2", "contribution")] == 0.5 and acc[("all", "random")] == 0.5
    assert s["best_baselines"] == {"0.5": "random"}
    assert (out / "kvtasks-accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"   # the command's figure

    assert merge.main(["--out", str(tmp_path / "pdf"), "--figure-format", "PDF", str(a), str(b)]) == 0
    assert (tmp_path / "pdf" / "kvtasks-accuracy.pdf").read_bytes()[:5] == b"%PDF-"
    assert merge.main(["--out", str(tmp_path / "bare"), "--no-figures", str(a), str(b)]) == 0
    assert not list((tmp_path / "bare").glob("kvtasks-accuracy.*"))
    capsys.readouterr()
    assert merge.main(["--out", str(tmp_path / "bad"), "--figure-format", "nope", str(a), str(b)]) == 2
    assert "unknown figure format" in capsys.readouterr().err and not (tmp_path / "bad").exists()

    assert merge.main(["--out", str(out), str(a)]) == 2                              # never over a folder
    c = _run(tmp_path / "c", ["t1"], _rows("t1", [0, 1], {"full": full, "random": full, "contribution": full}),
             finished=True, mode="query-aware")
    assert merge.main(["--out", str(tmp_path / "m2"), str(a), str(c)]) == 2
    assert "differs from" in capsys.readouterr().err and not (tmp_path / "m2").exists()


def test_tables_show_the_summary(tmp_path):
    merge, tables = _tool("kvtasks_merge"), _tool("kvtasks_tables")
    full = {e: 1.0 for e in range(10)}
    a = _run(tmp_path / "a", ["t1"], _rows("t1", range(10), {
        "full": full, "random": {e: float(e < 3) for e in range(10)},
        "contribution": {e: float(e < 8) for e in range(10)}}), finished=True, examples=10)
    out = tmp_path / "m"
    assert merge.main(["--out", str(out), str(a)]) == 0
    s, pairs = tables.load(out)
    acc = tables.accuracy_table(s, pairs)
    assert "| full cache | 100 [100, 100] |" in acc and "| **contribution** | 80 [" in acc
    assert "| random | *30 [" in acc                                                 # the best baseline in italics
    v = tables.verdict_table(s)
    assert "| 0.5 | random | contribution | +50 [" in v
    assert tables.task_table(s, 0.5).splitlines()[0] == "| policy | t1 |"


def test_readme_table_names_every_geometry_policy_tied_for_best():
    tables = _tool("kvtasks_tables")
    acc = {"full": 0.5, "random": 0.6, "a": 0.4, "b": 0.4, "c": 0.4, "d": 0.3}
    delta = {"a": -0.2, "b": -0.2, "c": -0.1, "d": -0.3}            # c: as accurate, but a larger difference
    s = {"results": [{"task": "all", "policy": p, "ratio": 0.0 if p == "full" else 0.5, "accuracy": x}
                     for p, x in acc.items()],
         "best_baselines": {"0.5": "random"},
         "verdicts": [{"ratio": 0.5, "policy": p, "baseline": "random", "delta": d, "verdict": "loses"}
                      for p, d in delta.items()]}
    pairs = [{"policy": p, "geometry": True} for p in delta]
    assert tables.readme_table(s, pairs).splitlines()[-1] == "| 0.5 | 50 | random 60 | c 40 | -10 (loses) |"
    delta["c"] = -0.2
    s["verdicts"] = [{**v, "delta": delta[v["policy"]]} for v in s["verdicts"]]
    assert tables.readme_table(s, pairs).splitlines()[-1] == "| 0.5 | 50 | random 60 | a / b / c 40 | -20 (loses) |"


def test_pair_compares_any_two_policies_the_full_cache_included(tmp_path, capsys):
    """--pair on hand-made scores: contribution right on examples 0-7, random on 0-2, the full cache
    on all; t2's 10 examples weigh as much as t1's 20 over both tasks."""
    tables = _tool("kvtasks_tables")
    full = {e: 1.0 for e in range(20)}
    rows = pd.concat([
        _rows("t1", range(10), {"full": full, "random": {e: float(e < 3) for e in range(10)},
                                "contribution": {e: float(e < 8) for e in range(10)}}),
        _rows("t2", range(20), {"full": full, "random": {e: 0.0 for e in range(20)},
                                "contribution": {e: 0.0 for e in range(20)}})])
    run = _run(tmp_path / "a", ["t1", "t2"], rows, finished=True)
    one = tables.pair_table(run, "contribution", "random", ["t1"]).splitlines()
    assert "t1 (10 examples" in one[0]
    assert one[-1].startswith("| 0.5 | 80 [") and "| 30 [" in one[-1] and "| +50 [" in one[-1]
    assert one[-1].endswith("| 5 of 10 (5 / 0) |")
    both = tables.pair_table(run, "contribution", "full").splitlines()[-1]
    assert both.startswith("| 0.5 | 40 [") and "| 100 [100, 100] | -60 [" in both   # (0.8 + 0) / 2 - 1
    assert both.endswith("| 22 of 30 (0 / 22) |")
    assert tables.main([str(run), "--pair", "contribution", "h2o"]) == 2
    assert capsys.readouterr().err.strip() == f"kvtasks_tables: {run} has no h2o"
    assert tables.main([str(run), "--tasks", "t1"]) == 2
    assert tables.signed(-0.003) == "+0" and tables.signed(-0.006) == "-1"


def test_merge_reads_finished_runs_writes_strict_json_and_refuses_in_one_line(tmp_path, capsys):
    """A finished run kept without its checkpoint is read from run.json; intervals missing below 10
    examples are ``null`` (strict JSON, as the command writes them) and the tables print without them;
    what cannot be merged is one line and exit 2, with nothing written."""
    merge, tables = _tool("kvtasks_merge"), _tool("kvtasks_tables")
    full = {0: 1.0, 1: 1.0}
    a = _run(tmp_path / "a", ["t1"], _rows("t1", [0, 1], {"full": full, "random": {0: 0.0, 1: 1.0},
                                                           "contribution": full}), finished=True)
    import shutil

    shutil.rmtree(a / "checkpoint")
    out = tmp_path / "m"
    assert merge.main(["--out", str(out), str(a)]) == 0
    text = (out / "summary.json").read_text()
    assert "NaN" not in text and json.loads(text)["verdicts"][0]["low"] is None
    assert tables.main([str(out)]) == 0 and tables.main(["--readme", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| 0.5 | random | contribution | +50 | too few examples |" in printed
    assert "| 0.5 | 100 | random 50 | contribution 100 | +50 (too few examples) |" in printed

    other = _run(tmp_path / "b", ["t1"], _rows("t1", range(3), {"full": {e: 1.0 for e in range(3)},
                                                                 "random": {e: 1.0 for e in range(3)},
                                                                 "contribution": {e: 1.0 for e in range(3)}}),
                 finished=True, examples=3, seed=1)
    empty = tmp_path / "empty"
    (empty / "checkpoint").mkdir(parents=True)
    from attngeom.runs.run import seal

    (empty / "checkpoint" / "settings.json").write_text(json.dumps(seal({"command": "kvtasks", "settings":
                                                                         {**SETTINGS, "tasks": ["t1"]}}, "run-settings")))
    for runs, said in (([a, other], "differs from"), ([tmp_path / "nothing"], "neither run.json"),
                       ([empty], "no whole task")):
        assert merge.main(["--out", str(tmp_path / "m2"), *map(str, runs)]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "m2").exists()
    assert tables.main([str(tmp_path / "nothing")]) == 2
    assert "holds no summary.json" in capsys.readouterr().err


def test_merge_names_the_model_when_only_a_finished_run_records_its_name(tmp_path):
    """A finished run's answer rows carry the model's name, a stopped run's units do not: the summary
    and every merged row take the name, not a missing value of the first run's rows."""
    merge = _tool("kvtasks_merge")
    full = {0: 1.0, 1: 1.0}
    scores = {"full": full, "random": full, "contribution": full}
    a = _run(tmp_path / "a", ["t1", "t2"], _rows("t1", [0, 1], scores), finished=False)
    b = _run(tmp_path / "b", ["t2"], _rows("t2", [0, 1], scores).assign(model="Model-Name"), finished=True)
    out = tmp_path / "m"
    assert merge.main(["--out", str(out), str(a), str(b)]) == 0
    assert json.loads((out / "summary.json").read_text())["model"] == "Model-Name"
    answers = pd.read_parquet(out / "answers.parquet")
    assert set(answers["model"]) == {"Model-Name"} and set(answers["task"]) == {"t1", "t2"}


def _scores(examples, contribution):
    """The full cache right on every example, random wrong, contribution right where ``contribution(e)``."""
    return {"full": {e: 1.0 for e in examples}, "random": {e: 0.0 for e in examples},
            "contribution": {e: float(contribution(e)) for e in examples}}


def test_merge_adds_up_examples_across_runs_and_merged_folders(tmp_path, capsys):
    """Runs of --first-example 0 and 10 add up to 20 examples a task; the merged folder then joins
    a run of 20..29 into 30; an example given twice is taken from the first input; a task not whole
    in its run brings nothing."""
    merge = _tool("kvtasks_merge")
    r0, r10, r20 = range(0, 10), range(10, 20), range(20, 30)
    both = ["t1", "t2"]
    a = _run(tmp_path / "a", both, pd.concat([_rows(t, r0, _scores(r0, lambda e: e < 5)) for t in both]),
             finished=True, examples=10)
    b = _run(tmp_path / "b", both, pd.concat([_rows(t, r10, _scores(r10, lambda e: True)) for t in both]),
             finished=False, examples=10, first_example=10)
    m20 = tmp_path / "m20"
    assert merge.main(["--out", str(m20), str(a), str(b)]) == 0
    s = json.loads((m20 / "summary.json").read_text())
    assert s["examples"] == 40 and s["examples_per_task"] == {"t1": 20, "t2": 20}
    assert s["merged"] == [{"run": "a", "tasks": ["t1", "t2"], "examples": {"t1": "0-9", "t2": "0-9"}},
                           {"run": "b", "tasks": ["t1", "t2"], "examples": {"t1": "10-19", "t2": "10-19"}}]
    assert s["settings"] == {**{k: v for k, v in SETTINGS.items() if k != "examples"}, "allow_missing_weights": False}
    acc = {(r["task"], r["policy"]): (r["accuracy"], r["examples"]) for r in s["results"]}
    assert acc[("t1", "contribution")] == (0.75, 20) and acc[("all", "contribution")] == (0.75, 40)
    assert acc[("all", "random")] == (0.0, 40)
    assert sorted(set(pd.read_parquet(m20 / "answers.parquet")["example"])) == list(range(20))

    # t1 whole in c (20..29), t2 not (29 missing); b again: all of it taken already
    c = _run(tmp_path / "c", both, pd.concat([_rows("t1", r20, _scores(r20, lambda e: False)),
                                              _rows("t2", r20[:-1], _scores(r20[:-1], lambda e: False))]),
             finished=True, examples=10, first_example=20)
    m30 = tmp_path / "m30"
    assert merge.main(["--out", str(m30), str(m20), str(c), str(b)]) == 0
    assert "20 examples given again skipped" in capsys.readouterr().err
    s = json.loads((m30 / "summary.json").read_text())
    assert s["examples_per_task"] == {"t1": 30, "t2": 20} and s["examples"] == 50
    m20_from = json.loads((m20 / "summary.json").read_text())["merged"]     # the runs behind m20, kept
    assert [r["run"] for r in m20_from] == ["a", "b"]
    assert s["merged"] == [{"run": "m20", "tasks": ["t1", "t2"], "examples": {"t1": "0-19", "t2": "0-19"},
                            "from": m20_from},
                           {"run": "c", "tasks": ["t1"], "examples": {"t1": "20-29"}},
                           {"run": "b", "tasks": [], "examples": {}, "skipped": {"t1": "10-19", "t2": "10-19"}}]
    acc = {(r["task"], r["policy"]): r["accuracy"] for r in s["results"]}
    assert acc[("t1", "contribution")] == 0.5 and acc[("t2", "contribution")] == 0.75
    tables = _tool("kvtasks_tables")
    assert tables.tasks_said(s) == "2 tasks: t1 30, the others 20"          # the tables' heading
    assert tables.tasks_said(json.loads((m20 / "summary.json").read_text())) == "2 tasks"

    # first wins: a run of 0..9 scored otherwise (contribution always right) before the merged folder
    a2 = _run(tmp_path / "a2", ["t1"], _rows("t1", r0, _scores(r0, lambda e: True)), finished=True, examples=10)
    m = tmp_path / "first"
    assert merge.main(["--out", str(m), str(a2), str(m20)]) == 0
    s = json.loads((m / "summary.json").read_text())
    assert s["merged"][1] == {"run": "m20", "tasks": ["t1", "t2"], "examples": {"t1": "10-19", "t2": "0-19"},
                              "skipped": {"t1": "0-9"}, "from": m20_from}
    acc = {(r["task"], r["policy"]): r["accuracy"] for r in s["results"]}
    assert acc[("t1", "contribution")] == 1.0 and acc[("t2", "contribution")] == 0.75


def test_merge_refuses_other_settings_and_a_merged_folder_without_them(tmp_path, capsys):
    """A run that differs in a key of the identity other than examples and first_example is refused,
    against a run or a merged folder; so is a merged folder written before its outputs were sealed
    (no run.json), with a line that says how to fix it. A run that records no allow_missing_weights is the default."""
    merge = _tool("kvtasks_merge")
    r = range(2)
    a = _run(tmp_path / "a", ["t1"], _rows("t1", r, _scores(r, bool)), finished=True)
    m = tmp_path / "m"
    assert merge.main(["--out", str(m), str(a)]) == 0
    later = _run(tmp_path / "later", ["t1"], _rows("t1", range(2, 4), _scores(range(2, 4), bool)), finished=True,
                 first_example=2, allow_missing_weights=False)
    assert merge.main(["--out", str(tmp_path / "ok"), str(m), str(later)]) == 0
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["examples_per_task"] == {"t1": 4}
    capsys.readouterr()
    other = _run(tmp_path / "other", ["t1"], _rows("t1", range(2, 4), _scores(range(2, 4), bool)), finished=True,
                 first_example=2, length=128)
    doc = json.loads((m / "summary.json").read_text())
    del doc["settings"]
    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text(json.dumps(doc))
    (old / "answers.parquet").write_bytes((m / "answers.parquet").read_bytes())
    for runs, said in (([a, other], "differs from"), ([m, other], "in length"), ([old, later], "has no run.json")):
        assert merge.main(["--out", str(tmp_path / "m2"), *map(str, runs)]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "m2").exists()


def _examples(tasks, numbers, context: str = "c") -> list:
    """The examples of an ``examples.jsonl`` as the command writes it: ``numbers`` of each of ``tasks``."""
    from attngeom.kvcache import ruler

    return [ruler.Example(task=t, index=e, seed=0, context=f"{context} {t} {e}", question="\nq?",
                          answer_prefix="A:", answers=(str(e),), max_new_tokens=4, length=64)
            for t in tasks for e in numbers]


def test_merge_writes_the_examples_it_takes_when_every_input_holds_them(tmp_path, capsys):
    """The merged folder's ``examples.jsonl`` holds exactly the examples whose rows it took (the
    first input's, as for the rows), sorted by task and number; a merged folder passes them on; an
    input without ``examples.jsonl`` (a stopped run) leaves the file out, and the tool says why."""
    from attngeom.kvcache import ruler

    merge = _tool("kvtasks_merge")
    r0, r10, r20 = range(0, 10), range(10, 20), range(20, 30)
    both = ["t1", "t2"]
    a2 = _run(tmp_path / "a2", ["t1"], _rows("t1", r0, _scores(r0, lambda e: True)), finished=True, examples=10,
              jsonl=_examples(["t1"], r0, context="first"))
    a = _run(tmp_path / "a", both, pd.concat([_rows(t, r0, _scores(r0, lambda e: e < 5)) for t in both]),
             finished=True, examples=10, jsonl=_examples(both, r0))
    c = _run(tmp_path / "c", both, pd.concat([_rows(t, r10, _scores(r10, lambda e: True)) for t in both]),
             finished=True, examples=10, first_example=10, jsonl=_examples(both, r10, context="third"))
    m = tmp_path / "m"
    assert merge.main(["--out", str(m), str(a2), str(a), str(c)]) == 0
    assert "no examples.jsonl" not in capsys.readouterr().err
    got = ruler.read_jsonl(m / "examples.jsonl")
    assert [(ex.task, ex.index) for ex in got] == [(t, e) for t in both for e in range(20)]
    assert {ex.context.split()[0] for ex in got if ex.task == "t1" and ex.index < 10} == {"first"}   # a2 came first
    assert {ex.context.split()[0] for ex in got if ex.task == "t2" and ex.index < 10} == {"c"}
    assert {ex.context.split()[0] for ex in got if ex.index >= 10} == {"third"}

    d = _run(tmp_path / "d", both, pd.concat([_rows(t, r20, _scores(r20, lambda e: False)) for t in both]),
             finished=True, examples=10, first_example=20, jsonl=_examples(both, r20))
    m30 = tmp_path / "m30"
    assert merge.main(["--out", str(m30), str(m), str(d)]) == 0                # a merged folder passes its examples on
    assert [(ex.task, ex.index) for ex in ruler.read_jsonl(m30 / "examples.jsonl")] == \
        [(t, e) for t in both for e in range(30)]

    b = _run(tmp_path / "b", both, pd.concat([_rows(t, r20, _scores(r20, lambda e: True)) for t in both]),
             finished=False, examples=10, first_example=20)                   # stopped: no examples.jsonl
    mb = tmp_path / "mb"
    assert merge.main(["--out", str(mb), str(m), str(b)]) == 0
    assert f"no examples.jsonl ({b} has no examples.jsonl)" in capsys.readouterr().err
    assert not (mb / "examples.jsonl").exists() and (mb / "summary.json").is_file()

    c1 = _run(tmp_path / "c1", both, pd.concat([_rows(t, r10, _scores(r10, lambda e: True)) for t in both]),
              finished=True, examples=10, first_example=10, jsonl=_examples(both, r10)[:1])   # one example only
    mc = tmp_path / "mc"
    assert merge.main(["--out", str(mc), str(a), str(c1)]) == 0
    assert f"the examples.jsonl of {c1} lacks 19 of the examples taken from it" in capsys.readouterr().err
    assert not (mc / "examples.jsonl").exists()
    (c / "examples.jsonl").write_text("not json\n")          # changed after its run: verify says so
    assert merge.main(["--out", str(tmp_path / "bad"), str(a), str(c)]) == 2           # one line, nothing written
    err = capsys.readouterr().err
    assert err.startswith("kvtasks_merge: ") and err.count("\n") == 1 and not (tmp_path / "bad").exists()
    assert "examples.jsonl differs from the manifest's checksum" in err


# ---- issue 52: the tools read runs only through the runs' own verification, and refuse in one line ---------


def _sealed(path: Path, files: dict) -> Path:
    """A finished kvtasks run whose outputs are ``files`` (name -> bytes), as written: sealed by the run
    itself, so that only the tool's own reading can find them wrong."""
    from attngeom.runs.run import Run

    run = Run(path, "kvtasks", {**SETTINGS, "tasks": ["t1"]}, progress=False)

    def write(staging):
        for name, data in files.items():
            (staging / name).write_bytes(data)
        return list(files)

    run.finish(write)
    return path


def _one_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(prefix) and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_merge_refuses_a_run_changed_after_it_finished(tmp_path, capsys):
    """Defect 3 of issue 52: an answers.parquet changed after its run, and a run.json edited by hand,
    were merged, though attngeom.runs.verify said so."""
    merge = _tool("kvtasks_merge")
    r = range(2)
    a = _run(tmp_path / "a", ["t1"], _rows("t1", r, _scores(r, bool)), finished=True)
    b = _run(tmp_path / "b", ["t1"], _rows("t1", r, _scores(r, bool)), finished=True)
    _rows("t1", r, _scores(r, lambda e: True)).to_parquet(a / "answers.parquet")       # contribution always right
    doc = json.loads((b / "run.json").read_text())
    doc["settings"]["length"] = 4096                                                    # edited by hand
    (b / "run.json").write_text(json.dumps(doc))
    for run, said in ((a, "answers.parquet differs from the manifest's checksum"), (b, "not written by attngeom")):
        assert merge.main(["--out", str(tmp_path / "m"), str(run)]) == 2
        assert said in _one_line(capsys, "kvtasks_merge: ") and not (tmp_path / "m").exists()


def test_merge_refuses_unreadable_answers_and_an_output_it_cannot_write_in_one_line(tmp_path, capsys, monkeypatch):
    """Defect 14 of issue 52: a corrupt, truncated or column-less answers.parquet (here sealed by the run
    itself, so that the checksums agree), an unwritable --out and a full disk were tracebacks; a full
    disk left a folder that looked merged but had no figure. Now one line, and no --out at all."""
    import errno
    import io

    merge = _tool("kvtasks_merge")
    good = io.BytesIO()
    _rows("t1", range(2), _scores(range(2), bool)).to_parquet(good)
    columnless = io.BytesIO()
    _rows("t1", range(2), _scores(range(2), bool)).drop(columns="score").to_parquet(columnless)
    for name, data, said in (("corrupt", b"PAR1 not a parquet file", "cannot be read"),
                             ("truncated", good.getvalue()[:len(good.getvalue()) // 2], "cannot be read"),
                             ("columnless", columnless.getvalue(), "no column score")):
        run = _sealed(tmp_path / name, {"answers.parquet": data})
        assert merge.main(["--out", str(tmp_path / "m"), str(run)]) == 2, name
        assert said in _one_line(capsys, "kvtasks_merge: ") and not (tmp_path / "m").exists()

    a = _run(tmp_path / "a", ["t1"], _rows("t1", range(2), _scores(range(2), bool)), finished=True)
    (tmp_path / "file").write_text("a file")
    assert merge.main(["--out", str(tmp_path / "file" / "m"), str(a)]) == 2               # --out under a file
    assert "cannot write" in _one_line(capsys, "kvtasks_merge: ")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("attngeom.reports.kvtasks.render", full)                          # the disk fills at the figure
    assert merge.main(["--out", str(tmp_path / "m"), str(a)]) == 2
    assert "No space left on device" in _one_line(capsys, "kvtasks_merge: ")
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.partial-*"))


def test_merge_seals_its_folder_and_the_tables_refuse_what_verify_refuses(tmp_path, capsys):
    """Defect 15 of issue 52 (and 3 for the tables): a summary.json that is not JSON, nested too deeply
    or empty, and a corrupt pairs.parquet, were tracebacks of kvtasks_tables; a merged folder changed
    after it was written was printed. The merged folder is sealed like a run (run.json), so
    attngeom.runs.verify checks it."""
    from attngeom.runs import verify

    merge, tables = _tool("kvtasks_merge"), _tool("kvtasks_tables")
    a = _run(tmp_path / "a", ["t1"], _rows("t1", range(2), _scores(range(2), bool)), finished=True)
    m = tmp_path / "m"
    assert merge.main(["--out", str(m), str(a)]) == 0 and verify(m) == []
    assert tables.main([str(m)]) == 0
    capsys.readouterr()
    doc = json.loads((m / "summary.json").read_text())
    doc["length"] = 4096
    (m / "summary.json").write_text(json.dumps(doc))                                  # changed after the merge
    assert tables.main([str(m)]) == 2
    assert "summary.json differs from the manifest's checksum" in _one_line(capsys, "kvtasks_tables: ")
    assert tables.main(["--readme", str(m)]) == 2 and capsys.readouterr().out == ""
    summary = (a / "answers.parquet").read_bytes()
    for name, files in (("notjson", {"summary.json": b"{not json"}), ("deep", {"summary.json": b"[" * 100000}),
                        ("empty", {"summary.json": b""}), ("list", {"summary.json": b"[]"}),
                        ("pairs", {"summary.json": json.dumps(doc).encode(), "pairs.parquet": summary[:100]})):
        run = _sealed(tmp_path / name, files)
        assert tables.main([str(run)]) == 2, name
        _one_line(capsys, "kvtasks_tables: ")
        assert capsys.readouterr().out == ""
