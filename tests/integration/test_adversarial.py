"""Adversarial inputs at the command line: each is refused in one line with exit 2 (no traceback, no
output that looks complete, nothing of the user's deleted), or gives a meaningful result."""

from __future__ import annotations

import json
import shutil

import pytest

from attngeom.cli import main
from attngeom.runs.run import MANIFEST, verify


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err  # one clear line, nothing of transformers' own logging before it
    return lines[0]


def _model_dir(src, dst, **config):
    """A copy of the model folder ``src`` whose config.json has ``config`` changed."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ---- weights that do not fill the model its config describes --------------------------------------


@pytest.mark.parametrize("config,kind,tensor", [
    ({"num_hidden_layers": 4}, "missing", "model.layers.3."),           # the config says one layer more
    ({"num_hidden_layers": 2}, "unexpected", "model.layers.2."),                   # one layer less
    ({"intermediate_size": 96}, "of another shape", "mlp.down_proj.weight: checkpoint [64, 128] vs model [64, 96]"),
])
def test_weights_that_do_not_fit_the_config_are_refused(tiny_llama_dir, tmp_path, capfd, config, kind, tensor):
    bad = _model_dir(tiny_llama_dir, tmp_path / "bad", **config)
    out = tmp_path / "o"
    capfd.readouterr()
    rc = main(["analyze", "--model", str(bad), "--text", "The cat sat.", "--out", str(out), "--no-progress"])
    line = _one_line(capfd.readouterr().err)
    assert rc == 2 and f" {kind} (" in line and tensor in line and "--allow-missing-weights" in line, line
    assert not out.exists()


def test_a_config_transformers_refuses_is_refused_with_its_reason(tiny_llama_dir, tmp_path, capfd):
    # transformers' message opens with a line that only introduces the reason on its next line
    bad = _model_dir(tiny_llama_dir, tmp_path / "bad", hidden_size=65)
    capfd.readouterr()
    rc = main(["analyze", "--model", str(bad), "--text", "The cat sat.", "--out", str(tmp_path / "o"), "--no-progress"])
    line = _one_line(capfd.readouterr().err)
    assert rc == 2 and "config.json is not a usable model config" in line, line
    assert "hidden size (65) is not a multiple of the number of attention heads (4)" in line, line


def test_allow_missing_weights_loads_and_is_recorded(tiny_llama_dir, tmp_path, capfd):
    bad = _model_dir(tiny_llama_dir, tmp_path / "bad", num_hidden_layers=4)
    out = tmp_path / "o"
    args = ["analyze", "--model", str(bad), "--text", "The cat sat.", "--layers", "3", "--out", str(out),
            "--no-progress", "--allow-missing-weights"]
    capfd.readouterr()
    assert main(args) == 0
    err = capfd.readouterr().err
    warned = [x for x in err.splitlines() if "warning" in x]
    assert len(warned) == 1 and "model.layers.3." in warned[0] and "random" in warned[0], err
    assert json.loads((out / MANIFEST).read_text())["settings"]["allow_missing_weights"] is True
    # the same run without the flag is another run
    rc = main(args[:-1])
    assert rc == 2 and "allow_missing_weights" in _one_line(capfd.readouterr().err)


def test_tied_output_weights_are_not_missing(tmp_path):
    from safetensors import safe_open
    from tiny_models import tiny_model

    from attngeom import load_model

    handle = tiny_model("llama", tie_word_embeddings=True)
    handle.model.save_pretrained(tmp_path)
    handle.tokenizer.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()   # stored once, as the embeddings
    loaded = load_model(str(tmp_path))
    assert loaded.weights_not_loaded == {}
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()


# ---- finishing a run never deletes what attngeom did not write -------------------------------------

from test_cli_edges import TEXT, corpus  # noqa: E402,F401 (the corpus fixture the command tests share)


def _sinks(model, corpus, out, *extra):
    return main(["sinks", "--model", str(model), "--data", str(corpus), "--window", "24", "--max-windows", "1",
                 "--out", str(out), "--no-progress", "--no-figures", *extra])


@pytest.mark.parametrize("replacement", ["directory", "link"])
def test_an_output_replaced_by_the_users_own_is_not_deleted(tiny_llama_dir, corpus, tmp_path, capfd, replacement):
    out = tmp_path / "o"
    assert _sinks(tiny_llama_dir, corpus, out) == 0
    (out / "summary.json").unlink()
    mine = tmp_path / "user-data.txt"
    mine.write_text("mine")
    if replacement == "directory":
        (out / "summary.json").mkdir()
        shutil.copy(mine, out / "summary.json" / "user-data.txt")
    else:
        (out / "summary.json").symlink_to(mine)
    capfd.readouterr()
    rc = _sinks(tiny_llama_dir, corpus, out)
    line = _one_line(capfd.readouterr().err)
    assert rc == 2 and f"is a {replacement if replacement == 'directory' else 'link'}" in line, line
    if replacement == "directory":
        assert (out / "summary.json" / "user-data.txt").read_text() == "mine"
    else:
        assert (out / "summary.json").is_symlink() and mine.read_text() == "mine"
    assert verify(out) == ["summary.json is missing"] or verify(out) == ["summary.json differs from the manifest's checksum"]


# ---- only regular files are read ---------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--data", "--file"])
def test_a_fifo_is_refused_not_read(tiny_llama_dir, fifo, tmp_path, capfd, option):
    out = tmp_path / "o"
    args = (["sinks", "--data", str(fifo)] if option == "--data" else ["analyze", "--file", str(fifo)])
    rc = main([*args, "--model", str(tiny_llama_dir), "--out", str(out), "--no-progress"])
    line = _one_line(capfd.readouterr().err)
    assert rc == 2 and f"{fifo} is a FIFO (named pipe), not a file" in line, line
    assert not out.exists()


def test_dev_zero_is_refused_not_read(tiny_llama_dir, tmp_path, capfd, dev_zero):
    rc = main(["sinks", "--data", "/dev/zero", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "o"),
               "--no-progress"])
    assert rc == 2 and "/dev/zero is a character device, not a file" in _one_line(capfd.readouterr().err)


# ---- JSON nested too deeply: one line, never a RecursionError ----------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("command", ["analyze", "explore"])
def test_a_deeply_nested_chat_prompt_file(tiny_llama_dir, tmp_path, capfd, command):
    f = tmp_path / "deep.json"
    f.write_text(DEEP)
    rc = main([command, "--model", str(tiny_llama_dir), "--file", str(f), "--generate", "4", "--out",
               str(tmp_path / "o")])
    line = _one_line(capfd.readouterr().err)
    assert rc == 2 and f"{f}: JSON nested deeper than 64 levels" in line, line


def test_a_deeply_nested_trace_json_is_a_trace_format_error(tmp_path):
    from tiny_models import tiny_model

    from attngeom import Trace, analyze
    from attngeom.errors import TraceFormatError

    saved = analyze(tiny_model("llama"), "The cat sat.").save(tmp_path / "t")
    (saved / "trace.json").write_text(DEEP)
    with pytest.raises(TraceFormatError, match="trace.json: JSON nested deeper than 64 levels"):
        Trace.load(saved)


def test_a_deeply_nested_lock_file(tmp_path, monkeypatch):
    import fcntl

    from attngeom.runs import lock

    def no_flock(*a):
        raise OSError("flock not supported on this filesystem")   # the lock is judged by the pid it holds

    monkeypatch.setattr(fcntl, "flock", no_flock)
    (tmp_path / lock.LOCK).write_text(DEEP)
    lock.acquire(tmp_path)        # a holder that cannot be read is not alive: the lock is taken
    try:
        assert json.loads((tmp_path / lock.LOCK).read_text())["pid"] > 0
    finally:
        lock.release(tmp_path)


def test_a_deeply_nested_record_line_is_skipped(tiny_llama_dir, corpus, tmp_path, capfd):
    out = tmp_path / "o"
    assert _sinks(tiny_llama_dir, corpus, out) == 0
    records = sorted((out / "checkpoint").glob("records-*.jsonl"))
    (out / "summary.json").unlink()
    records[0].write_text(records[0].read_text() + DEEP + "\n")     # a damaged line: recomputed if needed
    capfd.readouterr()
    assert _sinks(tiny_llama_dir, corpus, out) == 0
    assert verify(out) == []


# ---- messages that name the real problem -------------------------------------------------------------


@pytest.mark.parametrize("budgets", ["0", "-8", "4,0"])
def test_budgets_below_one_are_blamed_on_budgets(corpus, tmp_path, capfd, budgets):
    rc = main(["kvcache", "--data", str(corpus), "--budgets", budgets, "--out", str(tmp_path / "o"), "--no-progress"])
    line = _one_line(capfd.readouterr().err)
    assert rc == 2 and "--budgets: a budget is a number of cache entries, at least 1" in line and "--chunk" not in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_an_out_that_is_a_broken_symlink_is_called_so(corpus, tmp_path, capfd, kind):
    out = tmp_path / "o"
    if kind == "dangling":
        out.symlink_to(tmp_path / "gone")
        said = f"--out {out} is a dangling symlink (its target {tmp_path / 'gone'} does not exist)"
    else:
        out.symlink_to(tmp_path / "o2")
        (tmp_path / "o2").symlink_to(out)
        said = f"--out {out} is a symlink loop"
    rc = main(["analyze", "--text", "The cat sat.", "--out", str(out), "--no-progress"])
    line = _one_line(capfd.readouterr().err)
    assert rc == 2 and said in line, line
    assert out.is_symlink() and not (tmp_path / "gone").exists()


def test_a_symlink_loop_as_data_is_called_so(corpus, tmp_path, capfd):
    loop = tmp_path / "loop.txt"
    loop.symlink_to(tmp_path / "loop2.txt")
    (tmp_path / "loop2.txt").symlink_to(loop)
    rc = main(["sinks", "--data", str(loop), "--out", str(tmp_path / "o"), "--no-progress"])
    line = _one_line(capfd.readouterr().err)
    assert rc == 2 and f"data file {loop} is a symlink loop" in line and "not found" not in line


def test_a_model_in_training_mode_is_put_in_eval_mode_and_told(capfd):
    from tiny_models import tiny_model

    from attngeom import analyze

    handle = tiny_model("llama", attention_dropout=0.5)
    expected = analyze(handle, "The cat sat.").layers[0].attention
    handle.model.train()
    capfd.readouterr()
    got = analyze(handle, "The cat sat.").layers[0].attention
    line = _one_line(capfd.readouterr().err)
    assert "training mode (dropout active); it is now in eval mode" in line
    assert not handle.model.training and (got == expected).all()      # no dropout in what was analysed
    analyze(handle, "The cat sat.")
    assert capfd.readouterr().err == ""                                # said once


# ---- the thread count is part of a run's identity ----------------------------------------------------


def test_a_run_resumed_under_another_thread_count_is_refused(tiny_llama_dir, corpus, tmp_path, capfd):
    import torch

    threads = torch.get_num_threads()
    out = tmp_path / "o"
    try:
        torch.set_num_threads(1)
        assert _sinks(tiny_llama_dir, corpus, out) == 0
        assert json.loads((out / MANIFEST).read_text())["settings"]["threads"] == 1
        (out / MANIFEST).unlink()                     # an unfinished run: its records are kept
        (out / "summary.json").unlink()
        torch.set_num_threads(2)
        capfd.readouterr()
        rc = _sinks(tiny_llama_dir, corpus, out)
        line = _one_line(capfd.readouterr().err)
        assert rc == 2 and "sinks run with other settings (threads)" in line, line
        assert not (out / MANIFEST).exists()
        torch.set_num_threads(1)
        assert _sinks(tiny_llama_dir, corpus, out) == 0 and verify(out) == []
    finally:
        torch.set_num_threads(threads)


# ---- issue 52: the run lock's refusal ----------------------------------------------------------------------


def _held_elsewhere(directory, content: bytes):
    """The lock file of ``directory`` holding ``content``, flocked through a descriptor of its own (as
    another process holds it); returns that descriptor."""
    import fcntl
    import os

    from attngeom.runs import lock

    fd = os.open(directory / lock.LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, content)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


@pytest.mark.parametrize("since", ["1e300", "NaN", "-1e18", "true", '"yesterday"'])
def test_a_lock_held_since_an_impossible_time_is_refused_in_one_line(tmp_path, since):
    """Defect 16 of issue 52: a holder's ``since`` of 1e300, NaN or -1e18 crashed the refused process
    (time.localtime raised); the refusal names the holder and leaves the time out."""
    import os

    from attngeom.errors import InputError
    from attngeom.runs import lock

    fd = _held_elsewhere(tmp_path, f'{{"pid": 4242, "host": null, "since": {since}}}'.encode())
    try:
        with pytest.raises(InputError) as e:
            lock.acquire(tmp_path)
        assert "in use by process 4242;" in str(e.value) and "\n" not in str(e.value)
    finally:
        os.close(fd)


def test_a_holder_that_has_not_written_its_pid_yet_is_named_once_it_has(tmp_path, monkeypatch):
    """Defect 21 of issue 52: a holder takes the lock before it writes its pid, so a process refused
    in between said "another process". The refused process waits (boundedly) for the pid: here the
    holder writes it while the refused process waits for the first time."""
    import os
    import time

    from attngeom.errors import InputError
    from attngeom.runs import lock

    fd = _held_elsewhere(tmp_path, b"")
    waits = []

    def sleep(seconds):                            # the holder writes its pid during the first wait
        if not waits:
            os.pwrite(fd, b'{"pid": 4243, "host": null, "since": 0}', 0)
        waits.append(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    try:
        with pytest.raises(InputError) as e:
            lock.acquire(tmp_path)
        assert "in use by process 4243 " in str(e.value) and waits, str(e.value)
    finally:
        os.close(fd)


@pytest.mark.parametrize("seed", [str(10 ** 29), str(2 ** 64), "-1"])
def test_a_sampling_seed_torch_cannot_take_is_one_line_before_the_model_loads(no_model, tmp_path, capfd, seed):
    """Defect 17 of issue 52: --seed 10^29 with --sample overflowed in torch's manual_seed after the model
    loaded; a seed is a whole number from 0 to 2^64 - 1 (what torch.Generator takes)."""
    capfd.readouterr()
    rc = main(["analyze", "--text", "The cat sat.", "--generate", "2", "--sample", "--seed", seed,
               "--out", str(tmp_path / "o"), "--no-progress"])
    line = _one_line(capfd.readouterr().err)
    assert rc == 2 and "seed" in line and "18446744073709551615" in line, line
    assert not (tmp_path / "o").exists()


# ---- issue 52, defect 22: messages that said the wrong thing -------------------------------------------------


def test_claims_rivals_that_name_nothing_are_told_so(no_model, corpus, tmp_path, capfd):
    """``--rivals ''`` was told to "name each measure once"."""
    capfd.readouterr()
    rc = main(["claims", "--data", str(corpus), "--rivals", " , ", "--out", str(tmp_path / "o"), "--no-progress"])
    line = _one_line(capfd.readouterr().err)
    assert rc == 2 and "--rivals names no measure" in line and "once" not in line, line


def test_compare_with_an_empty_model_b_is_refused(no_model, tmp_path, capfd):
    """``--model-b ''`` silently compared the model with itself."""
    capfd.readouterr()
    rc = main(["compare", "--text", "The cat sat.", "--model-b", "", "--out", str(tmp_path / "o")])
    line = _one_line(capfd.readouterr().err)
    assert rc == 2 and "--model-b is empty" in line, line
    assert not (tmp_path / "o").exists()


def test_compare_refuses_unrelated_texts_before_analysing_them(tiny_llama_dir, tmp_path, capfd, monkeypatch):
    """Unrelated texts were refused only after both were analysed (43.7 s for two 1,500-token texts):
    the alignment is checked on the tokens first (here the analysis would fail the test)."""
    def analysed(*a, **k):
        raise AssertionError("analysed before the texts were found unrelated")

    monkeypatch.setattr("attngeom.traces.trace.analyze", analysed)
    capfd.readouterr()
    rc = main(["compare", "--model", str(tiny_llama_dir), "--text", "The cat sat on the mat.",
               "--text-b", "zzzzzzzzzzzzzzzzzzzzzzzzzzzzzz", "--out", str(tmp_path / "o")])
    err = capfd.readouterr().err
    line = err.strip().splitlines()[-1]                   # after the model's loading lines
    assert rc == 2 and "Traceback" not in err and line.startswith("attngeom compare: error: only"), err
    assert not (tmp_path / "o").exists()
