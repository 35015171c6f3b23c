"""attngeom kvtasks end to end: tables, report, resume, and bad input refused in one line before the
model loads."""

import json

import pandas as pd
import pytest

from attngeom.cli import main
from attngeom.kvcache.ruler import Example, read_jsonl, write_jsonl


@pytest.fixture
def examples(tmp_path):
    ex = [Example("toy" if i % 2 else "toy2", i, 0, "the key is abc. " * 3, "\nWhat is the key?", " The key is",
                  ("abc",), 4, 0) for i in range(4)]
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
