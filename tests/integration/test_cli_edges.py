"""Command-level edge cases of every command: each gets one line and exit 2 before any compute, or
a meaningful result."""

from __future__ import annotations

import json

import pytest

from attngeom.cli import main
from attngeom.runs.run import MANIFEST

TEXT = ("The cat sat on the mat. A dog ran to the park and back again, then slept by the door. ") * 10


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text(TEXT)
    return p


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err  # one clear line
    return lines[0]


@pytest.mark.parametrize("cmd,extra", [
    ("faithfulness", ["--layers", ","]),
    ("sinks", ["--layers", ","]),
    ("sinks", ["--removal-layers", ","]),
    ("selection", ["--layers", ","]),
    ("sinks", ["--stride", "0"]),
    ("selection", ["--stride", "0"]),
    ("heads", ["--stride", "0"]),
    ("faithfulness", ["--stride", "0"]),
])
def test_meaningless_options_are_refused_before_any_compute(no_model, cmd, extra, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main([cmd, "--data", str(corpus), "--out", str(out), "--no-progress", *extra])
    line = _err(capsys)
    assert rc == 2 and extra[0] in line, line
    assert not out.exists()


@pytest.mark.parametrize("cmd", ["analyze", "faithfulness", "sinks", "selection", "heads"])
def test_device_cuda_without_a_gpu(no_model, cmd, corpus, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    data = [] if cmd == "analyze" else ["--data", str(corpus)]
    rc = main([cmd, *data, "--device", "cuda", "--out", str(tmp_path / "o"), "--no-progress"])
    line = _err(capsys)
    assert rc == 2 and "cuda" in line and "no CUDA GPU" in line
    assert not (tmp_path / "o").exists()


def test_one_token_input_is_refused_and_json_is_strict(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    from attngeom.model.handle import ModelHandle

    real = ModelHandle.encode
    monkeypatch.setattr(ModelHandle, "encode", lambda self, text: real(self, text)[-1:])  # a tokenizer without BOS
    out = tmp_path / "o"
    rc = main(["analyze", "--model", str(tiny_llama_dir), "--text", "a", "--out", str(out), "--no-progress"])
    assert rc == 2 and "at least 2 tokens" in _err(capsys)
    assert not out.exists()
    monkeypatch.setattr(ModelHandle, "encode", real)
    rc = main(["analyze", "--model", str(tiny_llama_dir), "--text", "a", "--out", str(out), "--no-progress"])
    assert rc == 0  # BOS + one token: one query, tables with NaN where nothing is defined
    json.loads((out / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))


def test_file_keeps_carriage_returns(tiny_llama_dir, tmp_path):
    from attngeom import load_model

    text = "first line\r\nsecond\rthird"
    f = tmp_path / "crlf.txt"
    f.write_bytes(text.encode())
    out = tmp_path / "o"
    assert main(["analyze", "--model", str(tiny_llama_dir), "--file", str(f), "--out", str(out), "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["input"]["tokens"] == len(load_model(str(tiny_llama_dir)).encode(text))


def test_commands_do_not_overwrite_each_other(tiny_llama_dir, corpus, tmp_path, capsys):
    out = tmp_path / "shared"
    assert main(["analyze", "--model", str(tiny_llama_dir), "--text", "The cat sat.", "--out", str(out),
                 "--no-progress"]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    rc = main(["sinks", "--model", str(tiny_llama_dir), "--data", str(corpus), "--window", "24", "--max-windows", "1",
               "--out", str(out), "--no-progress", "--no-figures"])
    assert rc == 2 and "holds an attngeom analyze run" in _err(capsys)
    assert before == {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    # analyze into the same directory with another text: refused (other settings), then --overwrite
    rc = main(["analyze", "--model", str(tiny_llama_dir), "--text", "Another text.", "--out", str(out),
               "--no-progress"])
    assert rc == 2 and "other settings (text_sha256)" in _err(capsys)
    assert main(["analyze", "--model", str(tiny_llama_dir), "--text", "Another text.", "--out", str(out),
                 "--no-progress", "--overwrite"]) == 0
    capsys.readouterr()
    assert json.loads((out / MANIFEST).read_text())["settings"]["text_sha256"] != json.loads(
        before[MANIFEST])["settings"]["text_sha256"]


def test_write_error_after_the_model_pass_is_one_line(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    import attngeom.runs.storage as io

    real = io.atomic_write_bytes

    def fail_on_summary(path, data):
        if path.name == "summary.json":
            raise io.OutputError(f"cannot write {path}: No space left on device")
        return real(path, data)

    monkeypatch.setattr(io, "atomic_write_bytes", fail_on_summary)
    out = tmp_path / "o"
    rc = main(["analyze", "--model", str(tiny_llama_dir), "--text", TEXT[:60], "--out", str(out), "--no-progress"])
    assert rc == 2 and "No space left" in _err(capsys)
    assert not (out / MANIFEST).exists() and not list(out.glob(".staging-*")) and not list(out.glob("**/*.tmp*"))
    monkeypatch.setattr(io, "atomic_write_bytes", real)
    assert main(["analyze", "--model", str(tiny_llama_dir), "--text", TEXT[:60], "--out", str(out),
                 "--no-progress"]) == 0  # the same command finishes the run
    assert (out / MANIFEST).exists()


@pytest.mark.parametrize("extra", [False, True])
def test_pickle_only_model_folder_is_one_line_without_torch_hints(extra, tiny_llama_dir, tmp_path):
    """A folder with pytorch_model.bin and no safetensors is refused before transformers or torch
    unpickles anything: one line from attngeom, no torch warning, no hint to set weights_only=False.
    ``extra``: the pickle also holds a Python object (what weights_only=True itself would refuse)."""
    import os
    import shutil
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    model = tmp_path / "pickled"
    shutil.copytree(tiny_llama_dir, model)
    weights = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    torch.save({**weights, "note": __import__("argparse").Namespace(a=1)} if extra else weights,
               model / "pytorch_model.bin")
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, "-m", "attngeom", "analyze", "--model", str(model), "--text", "The cat sat.",
                        "--out", str(out), "--no-progress"], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "pytorch_model.bin" in lines[0] and "safetensors" in lines[0] and str(model) in lines[0]
    low = r.stderr.lower()
    assert "weights_only" not in low and "weights only" not in low and "Traceback" not in r.stderr
    assert not out.exists()


def test_file_with_a_byte_order_mark_is_read_without_it(tmp_path):
    import argparse

    from attngeom.commands.common import text_input

    f = tmp_path / "bom.txt"
    f.write_bytes(b"\xef\xbb\xbfThe cat sat.\r\n")
    text, source = text_input(argparse.Namespace(text=None, file=str(f)), "analyze")
    assert text == "The cat sat.\r\n" and source == str(f)
