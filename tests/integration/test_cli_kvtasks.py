"""attngeom kvtasks end to end: tables, report, resume, and bad input refused in one line before the
model loads."""

import json
import re

import pandas as pd
import pytest

from attngeom.cli import main
from attngeom.kvcache.ruler import Example, read_jsonl, write_jsonl


@pytest.fixture
def examples(tmp_path):
    ex = [Example("toy" if i % 2 else "toy2", i, 0, "the key is abc. " * 3, "\nWhat is the key?", " The key is",
                  ("abc",), 4, 76) for i in range(4)]
    return write_jsonl(ex, tmp_path / "examples.jsonl"), ex


def test_runs_writes_every_table_and_resumes(tiny_llama_dir, tmp_path, examples, capsys):
    path, ex = examples
    out = tmp_path / "out"
    args = ["kvtasks", "--model", str(tiny_llama_dir), "--examples-file", str(path), "--policies",
            "h2o,knorm,loo_head", "--ratios", "0.5,0.25", "--out", str(out), "--no-progress", "--no-figures"]
    assert main(args) == 0
    answers = pd.read_parquet(out / "answers.parquet")
    assert len(answers) == 4 * (1 + 3 * 2)                             # full once, 3 policies x 2 ratios
    assert set(answers["ratio"]) == {0.0, 0.25, 0.5} and answers["score"].between(0, 1).all()
    summary = pd.read_parquet(out / "summary.parquet")
    assert set(summary["task"]) == {"toy", "toy2", "all"}              # per task and over all tasks
    assert summary["low"].isna().all()                                 # 4 examples: no interval
    assert read_jsonl(out / "examples.jsonl") == ex
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == 4 and s["ratios"] == [0.25, 0.5] and s["mode"] == "question-agnostic"
    report = (out / "report.md").read_text()
    assert "too few examples" in report and "examples.jsonl" in report
    capsys.readouterr()
    assert main(args) == 0 and "already holds this complete run" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--policies", "full"], "ratio-0 reference"),
    (["--policies", "taxonomy"], "head taxonomy"),
    (["--policies", "nope"], "unknown KV-cache policy"),
    (["--ratios", "0.5,1"], "(0, 1)"),
    (["--ratios", "x"], "comma-separated list of numbers"),
    (["--tasks", "qa"], "unknown task"),
    (["--length", "10"], "--length"),
    (["--examples-file", "{missing}"], "not found"),
    (["--first-example", "-1"], "--first-example must be at least 0"),
    (["--examples-file", "{missing}", "--first-example", "10"], "an --examples-file brings its own"),
])
def test_bad_input_is_one_line_before_the_model_loads(no_model, tmp_path, capsys, extra, message):
    extra = [e.format(missing=tmp_path / "missing.jsonl") for e in extra]
    rc = main(["kvtasks", "--out", str(tmp_path / "o"), "--no-progress", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("line, message", [
    ('{"task": "t"}', "needs the fields"),
    ('[1, 2]', "expected a JSON object"),
    ('{"task": "t", "index": "0", "seed": 0, "context": "c", "question": "q", "answer_prefix": "", '
     '"answers": ["a"], "max_new_tokens": 4, "length": 0}', "'index' must be a whole number"),
    ('{"task": "t", "index": 0, "seed": 0, "context": "c", "question": "q", "answer_prefix": "", '
     '"answers": "a", "max_new_tokens": 4, "length": 0}', "'answers' must be a list of strings"),
])
def test_a_malformed_examples_file_is_one_line(no_model, tmp_path, capsys, line, message):
    f = tmp_path / "ex.jsonl"
    f.write_text(line + "\n")
    rc = main(["kvtasks", "--examples-file", str(f), "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0] and f"{f}:1" in err[0]


# ---- issue 52: the examples are checked once, at read time, against the model's positions ----------------

_LINE = {"task": "t", "index": 0, "seed": 0, "context": "the key is abc.", "question": "\nWhat is the key?",
         "answer_prefix": " The key is", "answers": ["abc"], "max_new_tokens": 4, "length": 43}


@pytest.mark.parametrize("change, message", [
    ({"max_new_tokens": -1}, "'max_new_tokens' must be at least 1"),            # defect 4
    ({"max_new_tokens": 0}, "'max_new_tokens' must be at least 1"),             # defect 4
    ({"length": -1}, "'length' must be at least 1"),                            # defect 4
    ({"index": -1}, "'index' must be at least 0"),                              # defect 4
    ({"task": "all"}, "task 'all'"),                                            # defect 5
    ({"task": ""}, "'task' is empty"),                                          # defect 11
    ({"answers": []}, "'answers' is empty"),                                    # defect 11
    ({"answers": ["abc", ""]}, "an empty answer"),                              # defect 11
    ({"context": "  "}, "'context' is empty"),                                  # defect 11
    ({"question": "What is the key?"}, "must begin with a newline"),           # defect 11: mid-token question
])
def test_examples_out_of_range_are_one_line_before_the_model_loads(no_model, tmp_path, capsys, change, message):
    """Defects 4, 5, 11 of issue 52: fields were checked for type only; each of these ran (and was sealed)."""
    f = tmp_path / "ex.jsonl"
    f.write_text(json.dumps(_LINE) + "\n" + json.dumps({**_LINE, "index": 1, **change}) + "\n")
    rc = main(["kvtasks", "--examples-file", str(f), "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0] and f"{f}:2" in err[0], err
    assert not (tmp_path / "o").exists()


def test_a_duplicated_example_is_refused_at_read_time(no_model, tmp_path, capsys):
    """Defect 11 of issue 52: two lines of one (task, index) failed only after all the compute."""
    f = tmp_path / "ex.jsonl"
    f.write_text(json.dumps(_LINE) + "\n" + json.dumps({**_LINE, "context": "other"}) + "\n")
    rc = main(["kvtasks", "--examples-file", str(f), "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"{f}:2" in err[0] and "line 1" in err[0] and "t/0" in err[0], err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra, message", [
    (["--length", "300"], "handles at most 256 positions"),                   # defect 1: 300 + 128 > 256
    (["--length", "1000000000"], "handles at most 256 positions"),            # defect 8: refused, not made
    (["--length", "100"], "100 tokens is too short"),                         # defect 12: a ValueError before
])
def test_a_length_the_model_or_the_task_cannot_take_is_one_line(tiny_llama_dir, tmp_path, capsys, extra, message):
    """Defects 1, 8 and 12 of issue 52 (the tiny Llama has 256 positions; niah_single answers in up
    to 128 tokens; its smallest prompt is over 100 characters, one token each)."""
    out = tmp_path / "o"
    rc = main(["kvtasks", "--model", str(tiny_llama_dir), "--tasks", "niah_single", "--examples", "1",
               "--policies", "window", "--ratios", "0.5", "--no-figures", "--no-progress", "--out", str(out), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0] and "Traceback" not in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("change", [{"context": "the key is abc. " * 16},          # defect 1: 300 tokens
                                    {"max_new_tokens": 10 ** 9}])                   # defect 9: 10^9 new tokens
def test_an_example_longer_than_the_model_is_refused_before_compute(tiny_llama_dir, tmp_path, capsys, change):
    """Defects 1 and 9 of issue 52: an example the model cannot read, or whose answer could not fit its
    positions, was run (or allocated its cache up front); now refused naming the example."""
    f = tmp_path / "ex.jsonl"
    f.write_text(json.dumps(_LINE) + "\n" + json.dumps({**_LINE, "index": 1, **change}) + "\n")
    out = tmp_path / "o"
    rc = main(["kvtasks", "--model", str(tiny_llama_dir), "--examples-file", str(f), "--policies", "window",
               "--ratios", "0.5", "--no-figures", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "example t/1" in err[0] and "handles at most 256" in err[0], err
    assert not out.exists()


def test_an_examples_file_records_its_examples_length(tiny_llama_dir, tmp_path, examples):
    """Defect 2 of issue 52: summary.json said the unused default --length 4096; it records the longest
    example's tokens in the model's tokenizer (one per character here, no BOS)."""
    path, ex = examples
    out = tmp_path / "o"
    assert main(["kvtasks", "--model", str(tiny_llama_dir), "--examples-file", str(path), "--policies", "window",
                 "--ratios", "0.5", "--no-figures", "--no-progress", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["length"] == max(len(e.context + e.question + e.answer_prefix) for e in ex) == 76


def test_pgf_without_latex_is_refused_before_the_model_loads(no_model, tmp_path, capsys, monkeypatch):
    """Defect 13 of issue 52: --figure-format pgf needs LaTeX; without it the run failed after the analysis."""
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    rc = main(["kvtasks", "--figure-format", "pgf", "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "pgf" in err[0] and "LaTeX" in err[0], err
    assert not (tmp_path / "o").exists()


def test_the_api_checks_examples_made_in_code(tiny_llama, monkeypatch):
    """Defects 1, 4, 5 and 11 of issue 52 through the API: tasks.experiment checks examples made in code
    as read_jsonl checks a file's (one line naming the example, before any prefill), and a context that
    cannot be split from its question is an InputError naming the example, not a ValueError."""
    from attngeom.errors import InputError
    from attngeom.kvcache import prefill, ruler, tasks
    from attngeom.kvcache.settings import KVTaskSettings

    def no_prefill(*a, **k):
        raise AssertionError("a prefill ran although the examples are bad")

    monkeypatch.setattr(prefill, "prefill", no_prefill)
    ok = Example(**{**_LINE, "answers": ("abc",)})
    settings = KVTaskSettings(("window",), (0.5,))
    for bad, said in (({"max_new_tokens": -1}, "example t/1: field 'max_new_tokens' must be at least 1"),
                      ({"task": "all", "index": 0}, "task 'all'"),
                      ({"index": 0}, "t/0 is given twice"),
                      ({"context": "x" * 300}, "example t/1 (")):
        with pytest.raises(InputError, match=re.escape(said)):
            tasks.experiment(tiny_llama, None, [ok, Example(**{**_LINE, "index": 1, "answers": ("abc",), **bad})],
                             settings)

    def straddles(*a, **k):
        raise ValueError("a token straddles the start of the question; the context cannot be split from it")

    monkeypatch.setattr(ruler, "encode_example", straddles)
    with pytest.raises(InputError, match="example t/0: a token straddles"):
        tasks.experiment(tiny_llama, None, [ok], settings)
