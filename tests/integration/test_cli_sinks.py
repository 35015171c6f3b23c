"""attngeom sinks end to end: tables, figures, chosen layers and bad input."""

import json

import numpy as np
import pandas as pd

from attngeom.cli import main


def test_cli_whole_pipeline_on_a_tiny_model(tiny_llama_dir, tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(["The cat sat on the mat. The dog slept by the door, and the bird sang."] * 4))
    out = tmp_path / "out"
    rc = main(["sinks", "--model", str(tiny_llama_dir), "--data", str(data), "--window", "40", "--max-windows", "3",
               "--out", str(out)])
    assert rc == 0
    for f in ("heads.parquet", "curve.parquet", "drift.parquet", "hist.parquet", "removal.parquet", "ppl.parquet",
              "summary.json", "sinks-convexity.png", "sinks-rho-star.png", "sinks-anti-alignment.png",
              "sinks-decomposition.png", "sinks-removal.png", "sinks-drift.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    summary = json.loads((out / "summary.json").read_text())
    assert summary["windows"] == 3
    (name, m), = summary["models"].items()
    for k in ("anti_aligned_share", "interior_minimum_share", "fit_convex_share", "cos_v0_vj_anti_aligned_share"):
        assert 0.0 <= m[k] <= 1.0, k
    assert m["value_norm_ratio"] > 0 and m["raw_value_norm_ratio"] > 0
    assert -1 <= m["cos_v0_m_median"] <= 1
    assert np.isfinite(m["removal_delta_ppl"]) and np.isfinite(m["control_delta_ppl"])
    assert m["ppl"] > 1
    assert m["removed_mass_sink"] > 0 and m["removed_mass_control"] > 0
    assert m["cos_output_semantic_base"] <= 1 + 1e-6
    for part in ("sink", "tail"):
        d = m["decomposition"][part]
        assert abs(d["share_attention"] + d["share_relative_norm"] + d["share_cosine"] - 1) < 1e-6
    heads = pd.read_parquet(out / "heads.parquet")
    assert len(heads) == 3 * 4                                 # tiny llama: 3 layers x 4 heads
    assert heads.sink_rate.between(0, 1).all()
    removal = pd.read_parquet(out / "removal.parquet")
    # after sink removal every head output is its own semantic mean
    assert np.allclose(removal[removal["mode"] == "sink"].cos_output_semantic, 1.0, atol=1e-4)
    ppl = pd.read_parquet(out / "ppl.parquet").set_index("pass")
    assert ppl.loc["none", "delta_ppl"] == 0
    assert np.isclose(ppl.loc["sink", "delta_ppl"], m["removal_delta_ppl"])


def test_cli_chosen_layers_and_bad_input(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text("some words to read, again and again, some more words to read.\n" * 3)
    out = tmp_path / "out"
    rc = main(["sinks", "--model", str(tiny_llama_dir), "--data", str(data), "--window", "24", "--max-windows", "2",
               "--layers", "1", "--removal-layers", "2", "--no-figures", "--out", str(out)])
    assert rc == 0
    heads = pd.read_parquet(out / "heads.parquet")
    assert set(heads.layer) == {1}
    removal = pd.read_parquet(out / "removal.parquet")
    edited = removal[removal["mode"] == "sink"].groupby("layer").removed_mass.mean()
    assert edited.loc[2] > 0 and edited.loc[1] == 0
    rc = main(["sinks", "--model", str(tiny_llama_dir), "--data", str(data), "--layers", "7", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "layer 7" in capsys.readouterr().err
