"""Start-up: ``attngeom --help`` and argument errors answer without importing torch,
transformers, pandas or matplotlib (within 1.5 s), and ``python -m attngeom`` works."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attngeom.cli import COMMANDS, interrupted_message

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "pandas", "matplotlib", "safetensors")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}

PROBE = """
import runpy, sys
sys.argv = ["attngeom", *sys.argv[1:]]
try:
    runpy.run_module("attngeom", run_name="__main__", alter_sys=True)
finally:
    print("HEAVY=" + ",".join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
"""


def probe(*args):
    """``python -m attngeom ARGS`` in a fresh process; reports the heavy modules it imported."""
    r = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *args], capture_output=True,
                       text=True, env=ENV, cwd=ROOT, timeout=120)
    heavy = [line[6:] for line in r.stderr.splitlines() if line.startswith("HEAVY=")]
    assert heavy and "Traceback" not in r.stderr, r.stderr
    return r, [m for m in heavy[-1].split(",") if m]


def best_of(cmd, n=3):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, env=ENV, cwd=ROOT, timeout=120)
        times.append(time.perf_counter() - t)
    return min(times)


def test_import_attngeom_is_light():
    code = ("import sys, attngeom, attngeom.cli, attngeom.data.corpora, attngeom.errors; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""
    # the public names still resolve (and then do import torch)
    code = "import attngeom, sys; attngeom.Trace, attngeom.load_model, attngeom.metrics.formulas; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def test_lazy_names_resolve():
    import attngeom

    assert set(attngeom.__all__) <= set(dir(attngeom))
    assert attngeom.InputError.__module__ == "attngeom.errors"
    with pytest.raises(AttributeError):
        attngeom.no_such_name  # noqa: B018
    # submodules resolve as attributes too, as when the package imported them eagerly
    assert attngeom.data.corpora.SAMPLE_TEXT and attngeom.errors.TraceFormatError is attngeom.TraceFormatError


def test_python_m_attngeom_help_imports_nothing_heavy():
    r, heavy = probe("--help")
    assert r.returncode == 0, r.stderr
    assert "usage: attngeom" in r.stdout and "analyze" in r.stdout
    assert heavy == [], f"--help imported {heavy}"


@pytest.mark.parametrize("command", COMMANDS)
def test_argument_errors_import_nothing_heavy(command):
    r, heavy = probe(command, "--no-such-option")
    assert r.returncode == 2
    assert "error:" in r.stderr
    assert heavy == [], f"an argument error of {command} imported {heavy}"
    r, heavy = probe(command, "--help")
    assert r.returncode == 0 and f"usage: attngeom {command}" in r.stdout
    assert heavy == [], f"{command} --help imported {heavy}"


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_parser_is_light(command):
    """Names the culprit when the tests above fail: a command module (or its ``add_parser``) that
    imports torch/transformers/pandas/matplotlib at import time instead of inside ``run``."""
    code = (f"import argparse, sys, attngeom.commands.{command} as m; "
            "m.add_parser(argparse.ArgumentParser().add_subparsers()); "
            f"print(','.join(x for x in {HEAVY!r} if x in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"attngeom.commands.{command} imports {r.stdout.strip()} before run()"


def test_help_time_budget():
    """Within 1.5 s. Measured on the shared 2-core machine: ``python -c pass`` ~0.02 s,
    ``python -m attngeom --help`` ~0.1 s (importing torch alone takes ~2.2 s). Best of 3, minus the
    interpreter's own start-up, so a loaded machine does not fail it."""
    base = best_of([sys.executable, "-c", "pass"])
    helped = best_of([sys.executable, "-m", "attngeom", "--help"])
    assert helped - base < 1.5, f"--help took {helped:.2f} s (python -c pass: {base:.2f} s)"


def test_interrupted_message_says_where_the_checkpoint_is():
    msg = interrupted_message("out/sinks")
    assert msg == ("interrupted; finished units are kept in out/sinks/checkpoint and rerunning the same "
                   "command resumes")
    assert "checkpoint" in interrupted_message(None)
