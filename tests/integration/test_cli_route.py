"""``attngeom analyze --route`` (SPEC §10): the route asked is the route taken and recorded, the
tables of the fused route equal the block path's, and a route that does not exist is refused in one
line before any model is loaded."""

import pandas as pd

from attngeom.cli import main

TEXT = "The cat sat on the mat. The dog lay on the rug."


def test_an_unknown_route_is_refused_before_loading(no_model, capsys, tmp_path):
    assert main(["analyze", "--text", TEXT, "--route", "fast", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("attngeom analyze: error:")
    assert "route must be one of auto, fused, block, got 'fast'" in err
    assert not (tmp_path / "o").exists()


def test_the_fused_route_writes_the_block_paths_tables_and_records_itself(tiny_llama_dir, tmp_path):
    tables = {}
    for route in ("fused", "block"):
        out = tmp_path / route
        assert main(["analyze", "--model", str(tiny_llama_dir), "--text", TEXT, "--route", route, "--figure-layers", "0",
                     "--no-progress", "--out", str(out)]) == 0
        tables[route] = (pd.read_parquet(out / "heads.parquet"), pd.read_parquet(out / "tokens.parquet"))
    (hf, tf), (hb, tb) = tables["fused"], tables["block"]
    assert set(hf["route"]) == {"fused"} and set(hb["route"]) == {"block"}
    numeric = [c for c in hb.columns if hb[c].dtype.kind == "f"]
    pd.testing.assert_frame_equal(hf[numeric], hb[numeric], rtol=1e-4, atol=1e-5)
    numeric = [c for c in tb.columns if tb[c].dtype.kind == "f"]
    pd.testing.assert_frame_equal(tf[numeric], tb[numeric], rtol=1e-4, atol=1e-5)
    for c in ("winner_self", "winner_sink", "winner_other"):
        assert (hf[c] == hb[c]).all(), c
