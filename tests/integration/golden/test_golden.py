"""Before/after regression check: every CLI command on fixed tiny inputs gives what it gave when
golden_outputs.json was made (tables, JSON outputs, reports, console lines, verdicts, file lists).

The digest is made by make_golden.py (next to this file) running ``python -m attngeom ...`` with
this interpreter (about 2 minutes on one CPU thread); see its docstring for what is compared and
what is normalised away. To accept an intended change of outputs, remake the golden file::

    python tests/integration/golden/make_golden.py --out tests/integration/golden/golden_outputs.json

The test compares with the cross-machine tolerances (make_golden.LOOSE_PATHS, measured between AVX-512
and scalar ATen kernels), since the golden file was made on one CPU and the suite must hold on any;
ATTNGEOM_GOLDEN_TOLERANCE=strict compares with relative 1e-4 everywhere, which holds on the machine
that made the file (the digest is bit-for-bit the same run to run there): use it to check a
refactoring on that machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checks import load_script

HERE = Path(__file__).parent
SCRIPT = HERE / "make_golden.py"
GOLDEN = HERE / "golden_outputs.json"
SHOWN = 40


def _make_golden_module():
    return load_script(SCRIPT, "attngeom_make_golden")


@pytest.mark.slow
def test_cli_outputs_match_golden(tmp_path):
    mg = _make_golden_module()
    out = tmp_path / "digest.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--work", str(tmp_path / "work"),
                        "--python", sys.executable], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"make_golden.py failed (exit {r.returncode}):\n{r.stderr[-5000:]}"
    expected = json.loads(GOLDEN.read_text(encoding="utf-8"))
    actual = json.loads(out.read_text(encoding="utf-8"))
    loose = os.environ.get("ATTNGEOM_GOLDEN_TOLERANCE", "cross-machine") != "strict"
    diffs = mg.compare(expected, actual, loose=loose)
    if diffs:
        shown = "\n".join(f"  {d}" for d in diffs[:SHOWN])
        more = f"\n  ... and more ({len(diffs)} shown of at most 200)" if len(diffs) > SHOWN else ""
        pytest.fail(f"{len(diffs)} difference(s) from {GOLDEN.name} (expected vs got; runs in "
                    f"{tmp_path / 'work'}):\n{shown}{more}\nmake_golden.py said:\n{r.stderr[-2000:]}",
                    pytrace=False)


def test_compare_finds_differences():
    """The comparison itself: tolerances, printed numbers, lengths, types, keys (no CLI run)."""
    mg = _make_golden_module()
    a = {"x": 1.0, "n": 3, "s": "dPPL 0.1532 (2/2 windows)", "l": [1, 2], "v": "holds", "t": True}
    assert mg.compare(a, json.loads(json.dumps(a))) == []
    assert mg.compare(a, {**a, "x": 1.00005}) == []                      # within rel 1e-4
    assert len(mg.compare(a, {**a, "x": 1.001})) == 1
    assert mg.compare(a, {**a, "s": "dPPL 0.1533 (2/2 windows)"}) == []  # one printed digit apart
    assert len(mg.compare(a, {**a, "s": "dPPL 0.1540 (2/2 windows)"})) == 1
    assert len(mg.compare(a, {**a, "s": "dPPL 0.1532 (1/2 windows)"})) == 1  # integers exactly
    assert len(mg.compare(a, {**a, "n": 3.0})) == 1                      # int vs float
    assert len(mg.compare(a, {**a, "t": 1})) == 1                        # bool vs int
    assert len(mg.compare(a, {**a, "v": "refuted"})) == 1
    assert len(mg.compare(a, {**a, "l": [1, 2, 3]})) == 1
    b = dict(a)
    del b["v"]
    assert len(mg.compare(a, b)) == 1
    assert mg.compare({"sum_f16": 1.0}, {"sum_f16": 1.001}) == []        # float16 statistics
    # the explorer page's compressed size moves by a few bytes between CPUs: cross-machine only
    page = {"summary": {"page_bytes": 216534}}
    assert mg.compare(page, {"summary": {"page_bytes": 216543}}, loose=True) == []
    assert len(mg.compare(page, {"summary": {"page_bytes": 216543}})) == 1
    assert len(mg.compare(page, {"summary": {"page_bytes": 217534}}, loose=True)) == 1
    assert len(mg.compare({"n": 3}, {"n": 4}, loose=True)) == 1           # other integers stay exact
