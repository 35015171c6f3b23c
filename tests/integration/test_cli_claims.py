"""attngeom claims end to end on a tiny model: every claim gets a verdict, and the report and the
tables are written."""

import json

from attngeom import claims as CL
from attngeom.cli import main
from attngeom.heads.taxonomy import REGIMES


def test_claims_command_end_to_end(tiny_llama_dir, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("The sink collects attention | but adds *little* to the output. " * 40)
    out = tmp_path / "claims"
    args = ["claims", "--model", str(tiny_llama_dir), "--data", str(corpus), "--window", "16", "--max-windows", "12",
            "--calib-windows", "2", "--ratios", "0.3,0.6", "--ns", "2,4", "--repeats", "2", "--retentions", "100,75",
            "--bootstrap", "200", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    res = json.loads((out / "claims.json").read_text())
    ids = [r["id"] for r in res["rows"]]
    assert ids == [c["id"] for c in CL.CLAIMS]
    for r in res["rows"]:
        if r["id"] == "early_critical_head":     # measured on the 2 calibration windows only
            assert (r["verdict"], r["windows"], r["low"], r["high"]) == (CL.TOO_FEW, 2, None, None)
            continue
        assert r["verdict"] in (CL.HOLDS, CL.REFUTED, CL.INCONCLUSIVE)
        assert r["windows"] == (10 if r["id"].startswith("taxonomy_removal") else 12)
        if r["low"] is not None and r["high"] is not None:
            assert r["low"] <= r["high"]
    assert res["settings"]["bootstrap"] == 200
    heads = res["detail"]["heads"]
    assert sorted(heads["regime_order_chosen"]) == sorted(REGIMES)
    assert heads["regime_order_fixed"] == list(CL.DEFAULTS.fixed_order)
    assert len(heads["removal_curves"]) == 6
    # the four faithfulness claims are judged at each ratio too, and the report says so
    faith = [r for r in res["rows"] if r["id"].startswith(("hierarchy_", "contribution_best_"))]
    assert len(faith) == 4
    for r in faith:
        assert list(r["per_ratio"]["ratios"]) == ["0.3", "0.6"]
        assert all(d["verdict"] in (CL.HOLDS, CL.REFUTED, CL.INCONCLUSIVE) for d in r["per_ratio"]["ratios"].values())
    # the head-to-head: contribution against each published value-aware measure, in both modes
    h2h = [r for r in res["rows"] if r["id"].startswith("contribution_beats_")]
    rivals = ("leave_one_out", "value_zeroing", "alti", "grad_attention", "rollout", "contribution_rollout")
    assert [r["id"] for r in h2h] == [f"contribution_beats_{x}_{m}" for x in rivals
                                      for m in ("comprehensiveness", "sufficiency")]
    for r, x in zip(h2h, [x for x in rivals for _ in range(2)]):
        assert list(r["per_ratio"]["ratios"]) == ["0.3", "0.6"]
        assert list(r["numbers"]) == [f"contribution vs {x}"] and r["low"] <= r["high"]
    md = (out / "claims.md").read_text()
    assert md.count("Per removal ratio: r=0.3: ") == 4 + len(h2h) and "ΔPPL per removal ratio" in md
    assert "H2H: the head-to-head" in md
    assert md.count("\n| ") >= len(CL.CLAIMS) + 1
    assert "| too few windows |" in md and "## Terms" in md and "**semantic cone**" in md
    for c in CL.CLAIMS:
        assert c["id"].replace("_", "\\_") in md
    assert (out / "run.json").exists()
    # a rerun with the same settings finds the complete run and does nothing
    capsys.readouterr()
    assert main(args) == 0
    assert "already holds this complete run" in capsys.readouterr().err
    # argument errors before any compute
    assert main(args[:-5] + ["--bootstrap", "10", "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert main(args[:-5] + ["--fixed-order", "Mixer,Reset", "--out", str(tmp_path / "y"), "--no-progress"]) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
