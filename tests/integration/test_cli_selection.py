"""attngeom selection end to end, and its bad options refused before the model loads."""

import json

import pandas as pd
import pytest

from attngeom.cli import main
from attngeom import selection as SEL

TEXTS = ["The cat sat on the mat; the dog lay by the door.", "A short one, with commas."]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "c.txt"
    p.write_text(" ".join(TEXTS * 6))
    return p


def test_cli_end_to_end(tiny_llama_dir, corpus, tmp_path):
    out = tmp_path / "sel"
    rc = main(["selection", "--model", str(tiny_llama_dir), "--data", str(corpus), "--window", "24", "--max-windows", "2",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["bound_violations"] == 0 and s["ns"] == [1, 2, 4, 8, 16]
    for dist in ("euclidean", "cosine"):
        for part in ("with_sink", "without_sink"):
            assert set(s[dist][part]["f_topn"]) == {"1", "2", "4", "8", "16"} or \
                set(s[dist][part]["f_topn"]) == {1, 2, 4, 8, 16}
    assert s["euclidean"]["with_sink"]["f_topn"]["1"] == 1.0
    sel = pd.read_parquet(out / "selection.parquet")
    assert set(sel["kind"]) == set(SEL.SELECTION_KINDS)
    for f in s["figures"]:
        assert (out / f).stat().st_size > 10_000


@pytest.mark.parametrize("argv,needle", [
    (["--window", "64", "--ns", "1,2,64"], "not below the window length"),
    (["--window", "64", "--ns", "0,2"], "at least 1"),
    (["--window", "64", "--distances", "manhattan"], "--distances"),
    (["--window", "64", "--queries", "some"], "--queries"),
    (["--window", "64", "--repeats", "-1"], "--repeats"),
])
def test_cli_bad_options_before_load(no_model, capsys, tmp_path, corpus, argv, needle):
    rc = main(["selection", "--data", str(corpus), "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and needle in err, err


def test_cli_empty_corpus_before_load(no_model, capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    rc = main(["selection", "--data", str(empty), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "holds no text" in err
