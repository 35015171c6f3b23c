"""Run directories are safe to point anywhere: a folder is an attngeom run only when its run files
are sealed by attngeom (marker + own checksum); ``--overwrite`` removes exactly what a run wrote;
a lock keeps a second process out (and a lock left by ``kill -9`` is taken over)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from attngeom.runs import lock as runlock
from attngeom.cli import main
from attngeom.errors import InputError
from attngeom.runs.run import CHECKPOINT, MANIFEST, OUTPUTS, SETTINGS, Run, seal, unseal, verify

USER_FILES = {"data.csv": "a,b\n1,2\n", "paper.md": "# draft\n", "fig.png": "png", "notes.txt": "keep",
              "my_analysis.csv": "x\n1\n", "checkpoint/model.ckpt": "weights"}


def _user_files(d):
    for name, text in USER_FILES.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)


def _snapshot(d) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _write_outputs(d):
    (d / "table.parquet").write_text("t")
    (d / "summary.json").write_text("{}")
    return ["table.parquet", "summary.json"]


def _genuine(out, command="sinks", settings=None):
    run = Run(out, command, settings or {"a": 1}, progress=False)
    run.stage("sq", 2, lambda units: {"x": units})
    run.finish(_write_outputs)
    return run


def test_seal_round_trip_and_tampering(tmp_path):
    p = tmp_path / MANIFEST
    p.write_text(json.dumps(seal({"command": "sinks", "n": [1, 2.5]}, "run"), indent=2))
    assert unseal(p)["n"] == [1, 2.5]
    assert unseal(tmp_path / "absent" / MANIFEST) is None
    doc = json.loads(p.read_text())
    for bad in ({**doc, "n": [1, 2.6]}, {**doc, "attngeom": "run-settings"}, {k: v for k, v in doc.items()
                                                                            if k != "checksum"}, {}, []):
        p.write_text(json.dumps(bad))
        assert unseal(p) is False
    p.write_text("not json {")
    assert unseal(p) is False


@pytest.mark.parametrize("manifest", [
    json.dumps({"command": "train", "settings": {"lr": 0.1}, "files": {"data.csv": "0" * 64}}),  # another tool's
    "{}",
    "this is not JSON",
    "tampered",
])
def test_foreign_or_tampered_manifest_is_never_a_run(manifest, tmp_path):
    out = tmp_path / "o"
    if manifest == "tampered":  # a genuine run whose manifest was edited afterwards
        _genuine(out)
        doc = json.loads((out / MANIFEST).read_text())
        doc["files"]["data.csv"] = "0" * 64
        manifest = json.dumps(doc)
    else:
        out.mkdir()
    _user_files(out)
    (out / MANIFEST).write_text(manifest)
    before = _snapshot(out)
    for overwrite in (False, True):
        with pytest.raises(InputError) as e:
            Run(out, "sinks", {"a": 1}, overwrite=overwrite, progress=False)
        msg = str(e.value)
        assert "\n" not in msg and str(out) in msg and "not an attngeom run" in msg and "train" not in msg
    assert _snapshot(out) == before and verify(out)


def test_tampered_checkpoint_settings_are_not_a_run(tmp_path):
    out = tmp_path / "o"
    run = Run(out, "sinks", {"a": 1}, progress=False)
    run.stage("sq", 1, lambda units: {"x": units})
    run.close()
    p = out / CHECKPOINT / SETTINGS
    p.write_text(p.read_text().replace('"a": 1', '"a": 2'))
    with pytest.raises(InputError, match="settings.json was not written by this version of attngeom"):
        Run(out, "sinks", {"a": 2}, overwrite=True, progress=False)
    assert (out / CHECKPOINT / SETTINGS).exists()


def test_overwrite_removes_exactly_what_the_run_wrote(tmp_path):
    out = tmp_path / "o"
    _genuine(out)
    _user_files(out)
    (out / CHECKPOINT / "sub").mkdir()  # the user's own (empty) directory is kept too
    user = {k: v for k, v in _snapshot(out).items() if k in USER_FILES}
    r = Run(out, "selection", {"z": 0}, overwrite=True, progress=False)
    assert not r.resumed
    left = _snapshot(out)
    assert {k: left[k] for k in USER_FILES} == user  # every user file kept, byte for byte
    assert not (out / "table.parquet").exists() and not (out / "summary.json").exists()
    assert not (out / MANIFEST).exists() and not list((out / CHECKPOINT).glob("records-*"))
    assert (out / CHECKPOINT / "sub").is_dir()
    assert unseal(out / CHECKPOINT / SETTINGS)["command"] == "selection"  # the new run's
    r.close()


def test_overwrite_removes_outputs_of_a_run_killed_before_its_manifest(tmp_path, monkeypatch):
    out = tmp_path / "o"
    run = Run(out, "sinks", {"a": 1}, progress=False)
    run.stage("sq", 2, lambda units: {"x": units})
    real = os.replace

    def die_before_manifest(src, dst):
        if str(dst).endswith(MANIFEST):
            raise KeyboardInterrupt  # killed after the outputs were moved, before run.json
        return real(src, dst)

    monkeypatch.setattr(os, "replace", die_before_manifest)
    with pytest.raises(KeyboardInterrupt):
        run.finish(_write_outputs)
    monkeypatch.setattr(os, "replace", real)
    run.close()
    assert (out / "table.parquet").exists() and not (out / MANIFEST).exists()
    assert sorted(unseal(out / CHECKPOINT / OUTPUTS)["files"]) == ["summary.json", "table.parquet"]
    _user_files(out)
    Run(out, "heads", {}, overwrite=True, progress=False).close()
    assert not (out / "table.parquet").exists() and not (out / "summary.json").exists()
    assert all((out / k).read_text() == v for k, v in USER_FILES.items())


def test_overwrite_never_follows_a_link_out_of_the_run(tmp_path):
    """A listed output whose directory was replaced by a link to elsewhere is not deleted there."""
    out = tmp_path / "o"
    run = Run(out, "sinks", {"a": 1}, progress=False)

    def write(d):
        (d / "sub").mkdir()
        (d / "sub" / "t.json").write_text("{}")
        return ["sub/t.json"]

    run.finish(write)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "t.json").write_text("the user's")
    (out / "sub" / "t.json").unlink()
    (out / "sub").rmdir()
    (out / "sub").symlink_to(elsewhere)
    Run(out, "sinks", {"a": 2}, overwrite=True, progress=False).close()
    assert (elsewhere / "t.json").read_text() == "the user's"


def test_cli_overwrite_refuses_a_foreign_manifest_in_one_line(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text("The cat sat on the mat. " * 20)
    out = tmp_path / "o"
    out.mkdir()
    _user_files(out)
    (out / MANIFEST).write_text(json.dumps({"command": "train", "files": {}}))
    before = _snapshot(out)
    rc = main(["sinks", "--model", str(tiny_llama_dir), "--data", str(data), "--window", "16", "--max-windows", "1",
               "--out", str(out), "--no-progress", "--no-figures", "--overwrite"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1 and str(out) in err[0] and "not an attngeom run" in err[0], err
    assert _snapshot(out) == before


# --------------------------------------------------------------------------------------------
# The lock
# --------------------------------------------------------------------------------------------

HOLD = """
import sys, time
from attngeom.runs.run import Run
run = Run(sys.argv[1], "sinks", {"a": 1}, progress=False)
print("ready", flush=True)
time.sleep(120)
"""


def _holder(out):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_second_process_is_locked_out_and_a_killed_holder_is_taken_over(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "o"
    p = _holder(out)
    try:
        lock = json.loads((out / runlock.LOCK).read_text())
        assert lock["pid"] == p.pid and lock["host"]
        data = tmp_path / "corpus.txt"
        data.write_text("The cat sat on the mat. " * 20)
        rc = main(["sinks", "--model", str(tiny_llama_dir), "--data", str(data), "--window", "16",
                   "--max-windows", "1", "--out", str(out), "--no-progress", "--no-figures"])
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert rc == 2 and len(err) == 1 and f"in use by process {p.pid} since" in err[0], err
        with pytest.raises(InputError, match="in use by process"):
            Run(out, "sinks", {"a": 1}, overwrite=True, progress=False)
    finally:
        p.kill()  # kill -9: the lock file stays behind, its flock is gone
        p.wait()
    assert (out / runlock.LOCK).exists()
    r = Run(out, "sinks", {"a": 1}, progress=False)  # the stale lock is taken over
    assert r.resumed and json.loads((out / runlock.LOCK).read_text())["pid"] == os.getpid()
    r.close()
    assert not (out / runlock.LOCK).exists()  # released on close: no leftover file


def test_lock_by_pid_where_flock_is_missing(tmp_path, monkeypatch):
    import fcntl

    def no_flock(fd, op):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    import socket

    out = tmp_path / "o"
    out.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / runlock.LOCK).write_text(json.dumps({"pid": alive.pid, "host": socket.gethostname(),
                                                     "since": time.time()}))
        with pytest.raises(InputError, match=f"in use by process {alive.pid}"):
            Run(out, "sinks", {}, progress=False)
    finally:
        alive.kill()
        alive.wait()
    # the same pid, now dead on this host: a stale lock, taken over
    r = Run(out, "sinks", {}, progress=False)
    assert json.loads((out / runlock.LOCK).read_text())["pid"] == os.getpid()
    r.close()


def test_one_process_shares_its_own_lock(tmp_path):
    a = Run(tmp_path / "o", "t", {}, progress=False)
    b = Run(tmp_path / "o", "t", {}, progress=False)  # a resume in the same process is not refused
    assert b.resumed
    a.close()
    assert (tmp_path / "o" / runlock.LOCK).exists()
    b.close()
    assert not (tmp_path / "o" / runlock.LOCK).exists()
