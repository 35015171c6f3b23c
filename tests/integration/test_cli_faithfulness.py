"""attngeom faithfulness end to end: tables, resume, JSONL fields, a task, and bad input refused
with the output directory left as it was."""

import json

import pandas as pd
import pytest

from attngeom.cli import main
from checks import write_jsonl as _write

TEXT = ("The cat sat on the mat. A dog ran to the park and back again, then slept by the door. "
        "Rain fell all night; in the morning the streets were wet and quiet.")
BOOLQ = [{"passage": "Cats are mammals.", "question": "are cats mammals", "answer": True},
         {"passage": "The sun is cold.", "question": "is the sun hot", "answer": "false"}]


def _cli(tiny_llama_dir, out, *extra):
    return main(["faithfulness", "--model", str(tiny_llama_dir), "--out", str(out), "--no-progress", *extra])


def test_cli_runs_and_resumes(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT * 3)
    out = tmp_path / "out"
    args = ["--data", str(data), "--window", "32", "--max-windows", "2", "--metrics", "attention,random",
            "--ratios", "0.25,0.75", "--seeds", "0,1"]
    assert _cli(tiny_llama_dir, out, *args) == 0
    printed = capsys.readouterr().out
    assert "clean ppl" in printed and "attention" in printed
    table = pd.read_parquet(out / "table.parquet")
    assert len(table) == 2 * 2 + 2 * 2 * 2
    s = json.loads((out / "summary.json").read_text())
    assert s["units_done"] == 2 and set(s["metrics"]) == {"attention", "random"}
    man = json.loads((out / "run.json").read_text())
    assert man["command"] == "faithfulness" and man["complete"] and set(man["files"]) == {
        "table.parquet", "summary.json", "faithfulness.png", "report.md"}
    # the same command again: the run is complete, nothing is recomputed or rewritten
    before = {f: (out / f).stat().st_mtime_ns for f in man["files"]}
    assert _cli(tiny_llama_dir, out, *args) == 0
    assert "already holds this complete run" in capsys.readouterr().err
    assert before == {f: (out / f).stat().st_mtime_ns for f in man["files"]}
    # an explicit --dtype float32 is the default on CPU: the same run
    assert _cli(tiny_llama_dir, out, *args, "--dtype", "float32") == 0
    # JSONL with fields joined
    jl = tmp_path / "gsm.jsonl"
    _write(jl, [{"question": "How many legs has a cat?", "answer": "Four legs. " * 5}] * 3)
    assert _cli(tiny_llama_dir, tmp_path / "out2", "--data", str(jl), "--fields", "question,answer", "--window", "32",
                "--metrics", "contribution", "--ratios", "0.5") == 0
    # a task
    task = _write(tmp_path / "boolq.jsonl", BOOLQ)
    assert _cli(tiny_llama_dir, tmp_path / "out3", "--data", str(task), "--task", "boolq", "--metrics", "attention",
                "--ratios", "0.5") == 0
    assert json.loads((tmp_path / "out3" / "summary.json").read_text())["measure"] == "accuracy"


@pytest.mark.parametrize("extra,msg", [
    (["--ratios", "0,0.5"], "ratio 0 is outside (0, 1)"),
    (["--ratios", "0.5,1.2"], "ratio 1.2 is outside (0, 1)"),
    (["--ratios", "a,b"], "--ratios must be"),
    (["--metrics", "attention,saliency"], "unknown metric 'saliency'"),
    (["--metrics", "contribution,alti", "--per-head"], "alti is defined on the layer"),
    (["--window", "1000"], "longer than the model's context (256"),
    (["--layers", "0,7"], "layer 7 does not exist"),
    (["--fields", "question,nope"], "field 'nope' is missing"),
    (["--task", "mmlu"], "out of range"),
])
def test_cli_bad_input(tiny_llama_dir, tmp_path, capsys, extra, msg):
    data = tmp_path / "data.jsonl"
    _write(data, [{"question": "q", "choices": ["a", "b"], "answer": 3, "text": TEXT}])
    out = tmp_path / "out"
    rc = _cli(tiny_llama_dir, out, "--data", str(data), *extra)
    err = capsys.readouterr().err
    assert rc == 2 and msg in err, err
    assert not out.exists()  # a failed run leaves no directory behind
    # a directory that holds other files is refused before anything else, and left as it was
    out.mkdir()
    keep = out / "previous.txt"
    keep.write_text("earlier results")
    rc = _cli(tiny_llama_dir, out, "--data", str(data), *extra)
    err = capsys.readouterr().err
    assert rc == 2 and (msg in err or "not empty" in err), err
    assert keep.read_text() == "earlier results"
    assert sorted(p.name for p in out.iterdir()) == ["previous.txt"]


def test_cli_refuses_to_mix_settings(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    out = tmp_path / "out"
    base = ["--data", str(data), "--window", "32", "--max-windows", "1", "--metrics", "attention", "--ratios", "0.5"]
    assert _cli(tiny_llama_dir, out, *base) == 0
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for other in (["--layers", "0"], ["--ratios", "0.4"], ["--metrics", "contribution"], ["--seeds", "3"]):
        assert _cli(tiny_llama_dir, out, *base[:-4], *(other if other[0] == "--metrics" else base[6:8]),
                    *(other if other[0] != "--metrics" else base[8:])) == 2
        err = capsys.readouterr().err
        assert "other settings" in err and other[0].lstrip("-") in err, err
    assert before == {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # --overwrite replaces the run whole
    assert _cli(tiny_llama_dir, out, *base, "--layers", "0", "--overwrite") == 0
    assert json.loads((out / "run.json").read_text())["settings"]["layers"] == [0]
    assert len(list((out / "checkpoint").glob("records-*.jsonl"))) == 1


def test_missing_data_file_and_offline_dataset(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    assert _cli(tiny_llama_dir, tmp_path / "o", "--data", str(tmp_path / "nope.txt")) == 2
    assert "data file not found" in capsys.readouterr().err
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert _cli(tiny_llama_dir, tmp_path / "o", "--data", "hf:wikitext:wikitext-2-raw-v1") == 2
    err = capsys.readouterr().err
    assert "network" in err or "datasets" in err
