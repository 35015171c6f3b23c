"""Data-parallel runs under ``torchrun`` (2 CPU processes, gloo) against one process: the same numbers;
ranks with other settings refused; a killed rank stops the run and a rerun (any world size) resumes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from attngeom.runs.run import MANIFEST, verify
from test_runner import SLOW, TEXT, _argv, _outputs as _tables, _records

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed beside this Python")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ATTNGEOM_DIST_TIMEOUT": "120"}


def _torchrun(*args, nproc=2, timeout=600, script=None):
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(nproc)]
    cmd += ([script] if script else ["-m", "attngeom"]) + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


def _same(a: dict, b: dict, rtol: float) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        if k.endswith(".parquet"):
            pd.testing.assert_frame_equal(a[k], b[k], rtol=rtol, check_exact=False)
        else:
            assert json.dumps(a[k], sort_keys=True) == json.dumps(b[k], sort_keys=True) or rtol > 1e-9


@pytest.mark.parametrize("cmd", ["faithfulness", "sinks", "selection", "heads", "analyze"])
def test_two_processes_equal_one(cmd, tiny_llama_dir, tmp_path):
    """One unit per record on both sides, merged in unit order: equal to 1e-9 relative (in fact
    bit for bit). With batches of several units the batch composition differs between world
    sizes and float32 statistics agree to float-summation tolerance (rtol 1e-5)."""
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    one, two = tmp_path / "one", tmp_path / "two"
    r = subprocess.run([sys.executable, "-m", "attngeom", *_argv(cmd, tiny_llama_dir, data, one)],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    r = _torchrun(*_argv(cmd, tiny_llama_dir, data, two))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((two / MANIFEST).read_text())["world_size"] == 2 and not verify(two)
    assert len(list((two / "checkpoint").glob("records-r1-*.jsonl"))) == 1  # rank 1 recorded its own units
    rtol = 1e-5 if cmd == "heads" else 1e-9  # heads batches 2 windows per forward in this test
    _same(_tables(one), _tables(two), rtol)


CACHE_RACE = """
import json, sys
from pathlib import Path
import torch.distributed as dist
sys.path.insert(0, {tests!r})
from attngeom.model import gguf_cache
from tiny_models import tiny_model

dist.init_process_group("gloo")
rank, target, source = dist.get_rank(), Path({target!r}), Path({source!r})
handle = tiny_model("llama")
seen = {{}}
for turn in (1, 0):                     # rank 1 writes first, alone; then rank 0
    if rank == turn:
        seen["returned"] = str(gguf_cache.save_cache(handle.model, handle.tokenizer, target, source))
        seen["complete_after"] = gguf_cache.cache_complete(target)
        seen["exists_after"] = target.exists()
    dist.barrier()
Path({results!r}, f"rank{{rank}}.json").write_text(json.dumps(seen))   # a file: nothing lost in torchrun's pipes
dist.destroy_process_group()
"""


def test_only_the_saving_rank_writes_the_float_cache(tmp_path):
    """Under torchrun, transformers' ``save_pretrained`` writes weights from rank 0 only: the float
    cache of a GGUF model written by rank 1 held a tokenizer and no weights, was renamed into place
    and broke both ranks' loads of a bundled model on a fresh machine. Rank 1 now writes nothing
    (and keeps its model in memory); rank 0's cache is complete; no temp folder is left."""
    source = tmp_path / "src.gguf"
    source.write_bytes(b"GGUF")
    target = tmp_path / "cache" / "m"
    script = tmp_path / "race.py"
    results = tmp_path / "results"
    results.mkdir()
    script.write_text(CACHE_RACE.format(tests=str(Path(__file__).resolve().parents[1]), target=str(target),
                                        source=str(source), results=str(results)))
    r = _torchrun(script=str(script), timeout=300)
    said = f"stdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"
    assert r.returncode == 0, said
    assert sorted(p.name for p in results.iterdir()) == ["rank0.json", "rank1.json"], said
    rank0, rank1 = (json.loads((results / f"rank{k}.json").read_text()) for k in (0, 1))
    assert rank1 == {"returned": "None", "complete_after": False, "exists_after": False}
    assert rank0 == {"returned": str(target), "complete_after": True, "exists_after": True}
    assert (target / "model.safetensors").is_file() and (target / "config.json").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["m"]


def test_more_ranks_than_units(tiny_llama_dir, tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    r = _torchrun("sinks", "--data", str(data), "--window", "32", "--max-windows", "1", "--model", str(tiny_llama_dir),
                  "--out", str(tmp_path / "o"), "--no-progress", "--no-figures", nproc=3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["windows"] == 1


# Rank 1 is started with another window length.
MISMATCH = """
import os, sys
from attngeom.cli import main
argv = sys.argv[1:]
if os.environ["RANK"] == "1":
    argv[argv.index("--window") + 1] = "24"
sys.exit(main(argv))
"""


def test_ranks_with_other_settings_are_refused(tiny_llama_dir, tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    out = tmp_path / "o"
    r = _torchrun(*_argv("sinks", tiny_llama_dir, data, out), script=str(script))
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if "different settings" in x]
    assert len(lines) == 2 and all("window" in x for x in lines), r.stderr[-3000:]  # one line on every rank
    assert "/attngeom/" not in r.stderr and not out.exists()  # torchrun reports the failure; no traceback of ours


def test_a_killed_rank_stops_the_run_and_a_rerun_resumes(tiny_llama_dir, tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    full, part = tmp_path / "full", tmp_path / "part"
    argv = _argv("sinks", tiny_llama_dir, data, full)
    assert subprocess.run([sys.executable, "-m", "attngeom", *argv], env=ENV, capture_output=True,
                          timeout=600).returncode == 0
    script = tmp_path / "slow.py"
    script.write_text(SLOW.replace("sys.argv[1]", "3").replace("main(sys.argv[2:])", "main(sys.argv[1:])"))
    p = subprocess.Popen([TORCHRUN, "--standalone", "--nproc_per_node", "2", str(script),
                          *_argv("sinks", tiny_llama_dir, data, part)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    def rank_logs(rank):
        return list((part / "checkpoint").glob(f"records-r{rank}-*.jsonl")) if (part / "checkpoint").is_dir() else []

    # both ranks past their model load (else the survivor's one line is rightly about the load)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None and not (rank_logs(1) and rank_logs(0)):
        time.sleep(0.05)
    logs = rank_logs(1)
    assert logs, "rank 1 never recorded a unit"
    os.kill(int(logs[0].stem.rsplit("-", 1)[1]), signal.SIGKILL)  # the file name ends with the pid
    t0 = time.time()
    _, err = p.communicate(timeout=180)
    assert p.returncode != 0 and time.time() - t0 < 180  # no hang
    # the survivor says in one line of its own what happened and that a rerun resumes
    ours = [x for x in err.splitlines() if x.startswith("attngeom")]
    assert len(ours) == 1 and ours[0].startswith("attngeom sinks: error: rank 0 "), err[-3000:]
    assert "died or was killed" in ours[0] and "rerunning the same command resumes" in ours[0]
    assert "/attngeom/" not in err  # no traceback of ours (torchrun prints its own report)
    assert not (part / MANIFEST).exists()
    # a rerun with ONE process resumes from both ranks' records
    n = _records(part)
    r = subprocess.run([sys.executable, "-m", "attngeom", *_argv("sinks", tiny_llama_dir, data, part)],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    assert n >= 1 and _records(part) == 4  # 4 windows, one record each: only the missing were computed
    _same(_tables(full), _tables(part), 1e-9)


def test_nccl_without_a_gpu_is_one_line(monkeypatch, tiny_llama_dir, tmp_path, capsys):
    import torch

    from attngeom.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29999", "ATTNGEOM_DIST_BACKEND": "nccl"}.items():
        monkeypatch.setenv(k, v)
    data = tmp_path / "c.txt"
    data.write_text(TEXT)
    rc = main(["sinks", "--model", str(tiny_llama_dir), "--data", str(data), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "nccl backend needs CUDA" in err[0]
    assert not (tmp_path / "o").exists()
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("ATTNGEOM_DIST_BACKEND")
    rc = main(["sinks", "--model", str(tiny_llama_dir), "--data", str(data), "--out", str(tmp_path / "o")])
    assert rc == 2 and "launch with torchrun" in capsys.readouterr().err


def test_accelerate_launch_sets_the_same_environment(tiny_llama_dir, tmp_path):
    acc = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    if acc is None:
        pytest.skip("accelerate is not installed beside this Python")
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    one, two = tmp_path / "one", tmp_path / "two"
    assert subprocess.run([sys.executable, "-m", "attngeom", *_argv("sinks", tiny_llama_dir, data, one)],
                          capture_output=True, env=ENV, timeout=600).returncode == 0
    r = subprocess.run([acc, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                        "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "attngeom",
                        *_argv("sinks", tiny_llama_dir, data, two)], capture_output=True, text=True, env=ENV,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((two / MANIFEST).read_text())["world_size"] == 2
    _same(_tables(one), _tables(two), 1e-9)


def _comm(rank=0):
    from attngeom.runs.distributed import TorchComm

    comm = object.__new__(TorchComm)  # without a process group: only the error handling is used
    comm.rank, comm.world, comm._sigterm = rank, 2, None
    return comm


def test_a_failed_exchange_is_one_line_saying_the_run_resumes():
    from attngeom.runs.distributed import DistributedError

    def broken(*a, **k):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5555\nmore")

    with pytest.raises(DistributedError) as e:
        _comm(1)._call(broken)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rank 1 lost contact with the other processes (a rank died or was killed")
    assert "Connection closed by peer" in msg and msg.endswith("rerunning the same command resumes from the records "
                                                               "written so far")


def test_the_launchers_sigterm_becomes_one_line():
    from attngeom.runs.distributed import DistributedError

    comm = _comm(0)
    comm._sigterm = comm._catch_sigterm()
    try:
        with pytest.raises(DistributedError, match=r"^rank 0 was stopped by the launcher .* resumes from the records"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a second SIGTERM kills at once
    finally:
        signal.signal(signal.SIGTERM, comm._sigterm)
