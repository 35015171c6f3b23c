"""The experiment runner: records, resume, manifests, refusal of foreign runs, atomic outputs; and
for every corpus command, ``kill -9`` then rerun equals an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from attngeom.cli import main
from attngeom.errors import InputError, OutputError
from attngeom.runs.storage import decode_record, encode_record
from attngeom.runs.run import MANIFEST, InMemoryRun, Run, merge_sums, verify

TEXT = ("The cat sat on the mat. A dog ran to the park and back again, then slept by the door. "
        "Rain fell all night; in the morning the streets were wet and quiet. ") * 12


# --------------------------------------------------------------------------------------------
# Records and merging
# --------------------------------------------------------------------------------------------


def test_encode_round_trip_is_exact():
    x = {"a": np.arange(6, dtype=np.float64).reshape(2, 3) / 7, "n": 3, "f": float("nan"), "l": [1.5, "s"],
         "df": pd.DataFrame({"x": [1, 2], "s": ["a|b", "c"]}), "i": np.int64(4), "t": True}
    y = decode_record(json.loads(json.dumps(encode_record(x))))
    assert np.array_equal(y["a"], x["a"]) and y["a"].dtype == np.float64
    assert y["n"] == 3 and np.isnan(y["f"]) and y["l"] == [1.5, "s"] and y["i"] == 4 and y["t"] is True
    pd.testing.assert_frame_equal(y["df"], x["df"])


def test_merge_sums_adds_concatenates_and_weights():
    a = {"s": np.array([1.0, 2.0]), "n": 2, "rows": pd.DataFrame({"u": [0]}), "tag": "x"}
    b = {"s": np.array([10.0, 20.0]), "n": 3, "rows": pd.DataFrame({"u": [1, 1]}), "tag": "x", "extra": 1}
    m = merge_sums([a, b])
    assert np.array_equal(m["s"], [11.0, 22.0]) and m["n"] == 5 and list(m["rows"]["u"]) == [0, 1, 1]
    assert m["tag"] == "x" and m["extra"] == 1
    w = merge_sums([a, b], weights=[2, 0])  # a bootstrap resample: a twice, b not at all
    assert np.array_equal(w["s"], [2.0, 4.0]) and w["n"] == 4 and list(w["rows"]["u"]) == [0, 0]
    assert merge_sums([]) is None


def _square(calls):
    def work(units):
        calls.append(list(units))
        return {"x": [u * u for u in units]}
    return work


def test_stage_records_groups_and_resumes(tmp_path):
    calls = []
    run = Run(tmp_path / "r", "test", {"k": 1}, progress=False)
    recs = run.stage("sq", 7, _square(calls), group=3, group_key=lambda u: u < 4)
    assert calls == [[0, 1, 2], [3], [4, 5, 6]]  # groups never cross the key boundary
    assert [x for d in recs.values() for x in d["x"]] == [u * u for u in range(7)]
    # a new Run of the same settings reads the records: nothing is computed again
    calls.clear()
    again = Run(tmp_path / "r", "test", {"k": 1}, progress=False)
    assert again.resumed and again.stage("sq", 7, _square(calls), group=3) == recs and calls == []
    # only the missing units are computed (records of other stages are kept apart)
    assert again.stage("sq", 9, _square(calls), group=5)
    assert calls == [[7, 8]]
    assert InMemoryRun().stage("sq", 7, _square(calls), group=3, group_key=lambda u: u < 4) == recs


def test_changed_fingerprints_are_recomputed(tmp_path):
    calls = []
    Run(tmp_path, "test", {}, progress=False).stage("sq", 3, _square(calls), fingerprints=[1, 2, 3])
    calls.clear()
    Run(tmp_path, "test", {}, progress=False).stage("sq", 3, _square(calls), fingerprints=[1, 9, 3])
    assert calls == [[1]]


def test_a_cut_last_line_is_ignored(tmp_path):
    calls = []
    run = Run(tmp_path, "test", {}, progress=False)
    run.stage("sq", 2, _square(calls))
    log = next((tmp_path / "checkpoint").glob("records-*.jsonl"))
    log.write_text(log.read_text().splitlines()[0] + "\n" + log.read_text().splitlines()[1][:20])
    calls.clear()
    Run(tmp_path, "test", {}, progress=False).stage("sq", 2, _square(calls))
    assert calls == [[1]]


def test_directory_rules(tmp_path):
    out = tmp_path / "o"
    Run(out, "sinks", {"a": 1}, progress=False).finish(lambda d: (d / "t.json").write_text("{}") and ["t.json"])
    assert not verify(out)
    snapshot = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(InputError, match="holds an attngeom sinks run"):
        Run(out, "selection", {"a": 1})
    with pytest.raises(InputError, match=r"an attngeom sinks run with other settings \(a, b\)"):
        Run(out, "sinks", {"a": 2, "b": 0})
    assert snapshot == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert Run(out, "sinks", {"a": 1}).complete
    # --overwrite replaces the run whole
    r = Run(out, "selection", {"z": 0}, overwrite=True)
    assert not (out / "t.json").exists() and not (out / MANIFEST).exists() and not r.resumed
    # files that are not an attngeom run are never taken over, even with overwrite
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    for ow in (False, True):
        with pytest.raises(InputError, match="not empty and holds no attngeom run"):
            Run(other, "sinks", {}, overwrite=ow)
    assert (other / "notes.txt").read_text() == "keep"
    (tmp_path / "f").write_text("")
    with pytest.raises(OutputError, match="is a file"):
        Run(tmp_path / "f", "sinks", {})


def test_failed_run_leaves_no_directory_but_keeps_records(tmp_path):
    with pytest.raises(RuntimeError):
        with Run(tmp_path / "a", "t", {}, progress=False):
            raise RuntimeError("model failed to load")
    assert not (tmp_path / "a").exists()
    with pytest.raises(RuntimeError):
        with Run(tmp_path / "b", "t", {}, progress=False) as run:
            run.stage("sq", 2, _square([]))
            raise RuntimeError("later failure")
    assert list((tmp_path / "b" / "checkpoint").glob("records-*.jsonl"))  # finished work is kept


def test_finish_is_atomic_and_the_manifest_is_written_last(tmp_path, monkeypatch):
    out = tmp_path / "o"
    run = Run(out, "t", {}, progress=False)
    run.stage("sq", 2, _square([]))

    def write(d):
        (d / "a.json").write_text("1")
        (d / "b.json").write_text("2")
        return ["a.json", "b.json"]

    real = os.replace
    moved = []

    def replace_then_die(src, dst):
        if ".staging-" not in str(src):  # an atomic write (checkpoint/outputs.json), not an output's move
            return real(src, dst)
        if len(moved) == 1:
            raise KeyboardInterrupt  # killed between the two moves
        moved.append(dst)
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        run.finish(write)
    monkeypatch.setattr(os, "replace", real)
    assert (out / "a.json").exists() and not (out / MANIFEST).exists()  # incomplete: no manifest
    assert verify(out)
    again = Run(out, "t", {}, progress=False)
    assert again.resumed and not again.complete
    again.finish(write)
    man = json.loads((out / MANIFEST).read_text())
    assert set(man["files"]) == {"a.json", "b.json"} and man["complete"] and man["units"]["sq"]["done"] == 2
    assert not verify(out) and not list(out.glob(".staging-*"))
    (out / "b.json").write_text("changed")
    assert verify(out) == ["b.json differs from the manifest's checksum"]


# --------------------------------------------------------------------------------------------
# kill -9 then rerun equals an uninterrupted run, for every corpus command
# --------------------------------------------------------------------------------------------

# Runs the CLI with a pause after every appended record, so that a kill lands mid-run.
SLOW = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background parent may have ignored SIGINT
import attngeom.runs.run as R
real = R.Run._append
def slow(self, rec):
    real(self, rec)
    time.sleep(float(sys.argv[1]))
R.Run._append = slow
from attngeom.cli import main
sys.exit(main(sys.argv[2:]))
"""

COMMANDS = {
    "analyze": ["analyze", "--file", "{data}", "--window", "40", "--layers", "0,1", "--figure-layers", "0"],
    "faithfulness": ["faithfulness", "--data", "{data}", "--window", "32", "--max-windows", "3",
                     "--metrics", "attention,random", "--ratios", "0.5", "--seeds", "0", "--batch-rows", "2"],
    "sinks": ["sinks", "--data", "{data}", "--window", "32", "--max-windows", "4", "--batch-size", "1"],
    "selection": ["selection", "--data", "{data}", "--window", "32", "--max-windows", "4", "--batch-size", "1",
                  "--repeats", "2"],
    "heads": ["heads", "--data", "{data}", "--window", "24", "--max-windows", "4", "--calib-windows", "2", "--few-windows",
              "--batch-size", "2", "--retentions", "100,50"],
}
VOLATILE = {"seconds", "runtime_s", "started", "finished"}


def _argv(cmd, model, data, out):
    figures = ["--no-figures"] if cmd in ("sinks", "selection", "heads") else []
    return [a.format(data=data) for a in COMMANDS[cmd]] + ["--model", str(model), "--out", str(out), "--no-progress",
                                                           *figures]


def _outputs(out: Path) -> dict:
    res = {}
    for p in sorted(out.iterdir()):
        if p.suffix == ".parquet":
            res[p.name] = pd.read_parquet(p)
        elif p.name == "summary.json":
            res[p.name] = {k: v for k, v in json.loads(p.read_text()).items() if k not in VOLATILE}
    return res


def _records(out: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in (out / "checkpoint").glob("records-*.jsonl")) \
        if (out / "checkpoint").is_dir() else 0


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_kill_then_rerun_equals_an_uninterrupted_run(cmd, tiny_llama_dir, tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full = tmp_path / "full"
    r = subprocess.run([sys.executable, "-m", "attngeom", *_argv(cmd, tiny_llama_dir, data, full)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    part = tmp_path / "part"
    p = subprocess.Popen([sys.executable, "-c", SLOW, "3", *_argv(cmd, tiny_llama_dir, data, part)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 300
    while _records(part) < 1 and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert _records(part) >= 1 and not (part / MANIFEST).exists()  # killed mid-run
    r = subprocess.run([sys.executable, "-m", "attngeom", *_argv(cmd, tiny_llama_dir, data, part)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert not verify(part)
    a, b = _outputs(full), _outputs(part)
    assert a.keys() == b.keys() and a
    for k in a:
        if k.endswith(".parquet"):
            pd.testing.assert_frame_equal(a[k], b[k])
        else:
            assert json.dumps(a[k], sort_keys=True) == json.dumps(b[k], sort_keys=True)


def _main_at_one_thread(argv) -> int:
    """The CLI in this process at the one thread its killed subprocess used: the thread count is
    part of a run's identity, and the test process has whatever the machine gives it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(argv)
    finally:
        torch.set_num_threads(before)


def test_kvcache_kill_then_rerun_equals_an_uninterrupted_run(tiny_llama_dir, tmp_path):
    """kvcache's tables hold times, so only its measured columns are compared."""
    data = tmp_path / "corpus.txt"
    data.write_text("The cat sat on the mat. The dog slept by the door, and the bird sang.\n" * 6)
    args = ["kvcache", "--model", str(tiny_llama_dir), "--data", str(data), "--window", "32", "--max-windows", "2",
            "--policies", "full,h2o", "--budgets", "8", "--no-figures", "--no-progress", "--out"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert _main_at_one_thread(args + [str(tmp_path / "whole")]) == 0
    part = tmp_path / "part"
    p = subprocess.Popen([sys.executable, "-c", SLOW, "3", *args, str(part)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while _records(part) < 1 and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert 1 <= _records(part) < 4 and not (part / MANIFEST).exists()          # killed mid-run
    assert _main_at_one_thread(args + [str(part)]) == 0
    a, b = (pd.read_parquet(d / "reads.parquet") for d in (tmp_path / "whole", part))
    cols = ["window", "policy", "budget", "nll", "tokens", "ppl", "peak_bytes"]
    pd.testing.assert_frame_equal(a[cols], b[cols])


def test_ctrl_c_says_what_is_kept(tiny_llama_dir, tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    out = tmp_path / "o"
    p = subprocess.Popen([sys.executable, "-c", SLOW, "3", *_argv("sinks", tiny_llama_dir, data, out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while _records(out) < 1 and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130
    assert "interrupted" in err and "resume" in err and "Traceback" not in err
