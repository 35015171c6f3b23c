"""The code carries no unused import and no unused local variable (ruff's F401 and F841), in the
package, the tests, the benchmarks and the tools: dead names are removed, not left for the next reader."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("src", "tests", "benchmarks", "tools")
RULES = "F401,F841"


def test_no_unused_import_or_variable():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]' (pyproject.toml pins it)", pytrace=False)
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", RULES,
                           "--output-format", "concise", *CHECKED], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
