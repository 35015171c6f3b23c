"""attngeom heads end to end on two corpora, and its refusals."""

import json

import pandas as pd
import pytest

from attngeom.cli import main
from attngeom.runs.contract import MIN_SCORED_TOKENS
from attngeom.heads import orders as HO

TEXTS = ["The cat sat on the mat; the dog lay by the door.", "A shorter one, with commas."]


def test_cli_end_to_end_two_corpora(tiny_llama_dir, tmp_path):
    c1 = tmp_path / "a.txt"
    c1.write_text(" ".join(TEXTS * 8))
    c2 = tmp_path / "b.txt"
    c2.write_text("Completely different words go here, on and on. " * 6)
    out = tmp_path / "heads"
    rc = main(["heads", "--model", str(tiny_llama_dir), "--data", str(c1), "--data", str(c2), "--window", "24",
               "--max-windows", "4", "--calib-windows", "1", "--few-windows", "--out", str(out), "--no-progress"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert set(s["regime_share"]) == {str(c1), str(c2)}
    for shares in s["regime_share"].values():
        assert sum(shares.values()) == pytest.approx(1.0)
    assert 0 <= s["corpus_agreement"]["agreement"] <= 1
    assert set(s["perplexity"]) == set(HO.ORDERS)
    base = s["perplexity_base"]["heldout"]
    for name, curve in s["perplexity"].items():
        assert curve["100"] == pytest.approx(base)
        assert set(curve) == {"100", "90", "75", "50", "25"}
    assert sorted(s["taxonomy_regime_order"]) == sorted(["Retriever", "Mixer", "Reset"])
    heads = pd.read_parquet(out / "heads.parquet")
    assert len(heads) == 12 and {"regime", "regime_corpus2", "single_delta_ppl", "critical"} <= set(heads)
    rem = pd.read_parquet(out / "removal.parquet")
    assert set(rem[rem.retention == 50]["heads_removed"]) == {6}
    search = pd.read_parquet(out / "order_search.parquet")
    assert search["regime_order"].nunique() == 6
    for f in s["figures"]:
        assert (out / f).stat().st_size > 10_000
    report = (out / "report.md").read_text()                       # the count says what it rests on
    assert "from 1 calibration windows: fewer than 10, an example, not an estimate" in report
    assert "- 1 calibration window(s), fewer than 10: the critical heads and the regime order are an example" in report


def test_cli_too_few_windows(tiny_llama_dir, tmp_path, capsys):
    c1 = tmp_path / "a.txt"
    c1.write_text("tiny")
    rc = main(["heads", "--model", str(tiny_llama_dir), "--data", str(c1), "--window", "24", "--calib-windows", "1",
               "--few-windows", "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "held-out" in err


def test_texts_too_short_to_score_are_refused(tiny_llama_dir, tmp_path, capsys):
    """Head removal is a perplexity change: on texts with fewer than MIN_SCORED_TOKENS predicted tokens
    in a split it is refused in one line, before any removal is computed."""
    data = tmp_path / "short.csv"
    data.write_text("text\nthe cat\na dog\nthe mat\n")
    out = tmp_path / "h"
    rc = main(["heads", "--model", str(tiny_llama_dir), "--data", str(data), "--calib-windows", "1", "--few-windows",
               "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "the calibration split of" in err[0] and f"a perplexity change needs at least {MIN_SCORED_TOKENS}" in err[0]
    assert not list(out.rglob("summary.json"))


def test_three_corpora_refused_before_load(no_model, capsys, tmp_path):
    c = tmp_path / "c.txt"
    c.write_text("some text " * 50)
    rc = main(["heads", "--data", str(c), "--data", str(c), "--data", str(c), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "at most twice" in err and "Traceback" not in err


@pytest.mark.parametrize("ret", ["100,0", "101", "50,-5", "nan", ""])
def test_retention_outside_range_refused(no_model, capsys, tmp_path, ret):
    c = tmp_path / "c.txt"
    c.write_text("some text " * 50)
    rc = main(["heads", "--data", str(c), "--retentions", ret, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "retention" in err and "Traceback" not in err, err


def test_empty_corpus_refused_before_load(no_model, capsys, tmp_path):
    c = tmp_path / "c.txt"
    c.write_text("some text " * 50)
    e = tmp_path / "e.txt"
    e.write_text("\n \n")
    rc = main(["heads", "--data", str(c), "--data", str(e), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "holds no text" in err


@pytest.mark.parametrize("calib", ["4", "9"])
def test_fewer_calibration_windows_than_the_rule_needs_refused_before_load(no_model, capsys, tmp_path, calib):
    """Below 10 calibration windows the critical heads and the regime order are no estimate: refused in
    one line before the model loads (no_model fails any load), unless --few-windows asks for it."""
    c = tmp_path / "c.txt"
    c.write_text("some text " * 50)
    rc = main(["heads", "--data", str(c), "--calib-windows", calib, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "at least 10 calibration windows" in err[0] and "--few-windows" in err[0]
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_heads_help_states_the_default_and_the_cost(capsys):
    with pytest.raises(SystemExit):
        main(["heads", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default 10" in text and "270 per window" in text and "37 min" in text and "--few-windows" in text
