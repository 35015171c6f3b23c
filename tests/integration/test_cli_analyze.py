"""``attngeom analyze`` end to end on a tiny model saved as a local Hugging Face directory."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from attngeom import analyze, load_model
from attngeom.cli import main
from attngeom.data.corpora import SAMPLE_TEXT
from attngeom.runs.contract import ExperimentResult
from attngeom.runs.run import InMemoryRun


TEXT = "The cat sat on the mat; the dog lay by the door."


@pytest.fixture(scope="module")
def handle(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def run_default(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("analyze_out")
    rc = main(["analyze", "--model", str(tiny_llama_dir), "--text", TEXT, "--out", str(out)])
    assert rc == 0
    return out


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------


def test_files_written(run_default, handle):
    summary = json.loads((run_default / "summary.json").read_text())
    L = handle.num_layers
    expected = {"tokens.parquet", "heads.parquet", "summary.json", "report.md", "sinks_per_layer.png"}
    expected |= {f"maps_layer{l}.png" for l in range(L)} | {f"heads_layer{l}.png" for l in range(L)}
    assert expected <= set(summary["files"])
    for f in summary["files"]:
        p = run_default / f
        assert p.is_file() and p.stat().st_size > 0, f
    for f in summary["files"]:
        if f.endswith(".png"):
            assert (run_default / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (run_default / "report.md").read_text()
    for f in summary["files"]:
        assert f in report


def test_tables_and_summary_keys(run_default, handle, tiny_llama_dir):
    tokens = pd.read_parquet(run_default / "tokens.parquet")
    heads = pd.read_parquet(run_default / "heads.parquet")
    summary = json.loads((run_default / "summary.json").read_text())
    ids = handle.encode(TEXT)
    T, L, H = len(ids), handle.num_layers, handle.num_heads

    for col in ("text", "layer", "position", "input_position", "token_id", "token", "attention_received",
                "value_weighted_received", "output_normalized_received", "contribution_received",
                "value_norm", "sink_rate", "entropy", "output_norm"):
        assert col in tokens.columns, col
    assert len(tokens) == T * L
    first = tokens[tokens["layer"] == 0]
    assert first["token_id"].tolist() == ids
    assert first["token"].tolist() == handle.tokens(ids)
    assert (first["input_position"] == first["position"]).all()

    for col in ("layer", "head", "queries", "sink_rate", "sink_contribution", "sink_contribution_inter",
                "self_attention", "entropy", "head_output_norm", "head_share"):
        assert col in heads.columns, col
    assert len(heads) == L * H
    assert (heads["queries"] == T - 1).all()

    for key in ("model", "input", "T", "layers", "per_layer", "top_tokens", "runtime_s", "attngeom_version",
                "files", "mean_sink_attention", "mean_sink_contribution"):
        assert key in summary, key
    assert summary["T"] == T
    assert summary["layers"] == list(range(L))
    assert summary["model"]["spec"] == str(tiny_llama_dir)
    assert summary["model"]["architecture"] == "llama"
    assert [r["layer"] for r in summary["per_layer"]] == list(range(L))
    top = summary["top_tokens"]
    assert len(top["by_contribution_received"]) == 5 and len(top["by_attention_received"]) == 5
    assert summary["runtime_s"]["total"] > 0


def test_values_match_direct_analyze(run_default, handle):
    """heads.parquet / tokens.parquet / summary.json agree with the full trace of the same text."""
    tokens = pd.read_parquet(run_default / "tokens.parquet")
    heads = pd.read_parquet(run_default / "heads.parquet").set_index(["layer", "head"])
    summary = json.loads((run_default / "summary.json").read_text())
    trace = analyze(handle, TEXT)
    T = len(trace.ids)
    visible = np.tril(np.ones((T, T), dtype=bool))
    seen_by = visible.sum(0)
    for lt in trace.layers:
        l = lt.index
        for h in range(lt.num_heads):
            assert heads.loc[(l, h), "sink_rate"] == pytest.approx(lt.attention[h, 1:, 0].mean(), abs=1e-5)
            assert heads.loc[(l, h), "sink_contribution"] == pytest.approx(lt.contribution[h, 1:, 0].mean(), abs=1e-5)
            assert heads.loc[(l, h), "sink_contribution_inter"] == pytest.approx(
                lt.contribution_inter[h, 1:, 0].mean(), abs=1e-5)
            assert heads.loc[(l, h), "head_output_norm"] == pytest.approx(
                lt.head_output_norm[h, 1:].mean(), rel=1e-4)
        rows = tokens[tokens["layer"] == l].sort_values("position")
        for name in ("attention", "contribution", "value_weighted", "output_normalized"):
            score = lt.token_score(name)  # [T, T]
            want = (score * visible).sum(0) / seen_by
            np.testing.assert_allclose(rows[f"{name}_received"].to_numpy(), want, rtol=1e-4, atol=1e-5)
        per = summary["per_layer"][l]
        assert per["sink_attention"] == pytest.approx(lt.attention[:, 1:, 0].mean(), abs=1e-5)
        assert per["sink_contribution"] == pytest.approx(lt.contribution[:, 1:, 0].mean(), abs=1e-5)
        assert per["sink_contribution_to_layer_output"] == pytest.approx(
            lt.contribution_inter[:, 1:, 0].mean(1).sum(), abs=1e-5)
    # the summary's top tokens are the top of tokens.parquet at the middle layer
    top = summary["top_tokens"]
    assert top["min_seen_by"] == max(8, T // 4)
    mid = tokens[(tokens["layer"] == top["layer"]) & (T - tokens["position"] >= top["min_seen_by"])]
    best = mid.sort_values("contribution_received", ascending=False, kind="stable").head(5)
    assert [r["position"] for r in top["by_contribution_received"]] == best["position"].tolist()
    assert [r["token"] for r in top["by_contribution_received"]] == best["token"].tolist()


def test_layer_subset_window_and_heads(tiny_llama_dir, handle, tmp_path):
    """--layers, --figure-layers, --heads and --window on an input longer than the model's context."""
    ids = handle.encode(SAMPLE_TEXT)
    assert len(ids) > handle.max_positions  # the built-in text does not fit the tiny model
    out = tmp_path / "o"
    rc = main(["analyze", "--model", str(tiny_llama_dir), "--layers", "0,2", "--figure-layers", "2", "--heads", "0,3",
               "--window", "200", "--out", str(out), "--no-progress"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layers"] == [0, 2]
    assert summary["input"]["windows"] == int(np.ceil((len(ids) - 1) / 199))
    assert (out / "maps_layer2.png").is_file() and (out / "heads_layer2.png").is_file()
    assert not (out / "maps_layer0.png").exists()
    heads = pd.read_parquet(out / "heads.parquet")
    assert sorted(heads["layer"].unique()) == [0, 2]
    assert (heads["queries"] == len(ids) - 1).all()  # every non-BOS token is a query i > 0 exactly once
    tokens = pd.read_parquet(out / "tokens.parquet")
    layer0 = tokens[tokens["layer"] == 0]
    # every token of the input appears once outside the windows' BOS, at its own input position
    body = layer0[layer0["position"] > 0]
    assert sorted(body["input_position"]) == list(range(1, len(ids)))
    assert (body.sort_values("input_position")["token_id"].to_numpy() == np.array(ids[1:])).all()
    # a window is analysed as its own text: compare the second window with a direct analysis
    w1 = [ids[0]] + ids[1 + 199: 1 + 2 * 199]
    lt = analyze(handle, w1, layers=[2]).layers[2]
    rows = tokens[(tokens["layer"] == 2) & (tokens["text"] == 1)].sort_values("position")
    np.testing.assert_allclose(rows["sink_rate"].to_numpy()[1:], lt.attention[:, 1:, 0].mean(0), atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Bad input: exit 2, one message, no traceback, nothing computed
# ------------------------------------------------------------------------------------------------


def _fails(capsys, argv, *needles):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err
    assert "attngeom analyze: error:" in err
    assert err.strip().splitlines()[-1].startswith("attngeom analyze: error:")
    for n in needles:
        assert n in err, err
    return err


def test_empty_text(no_model, capsys, tmp_path):
    _fails(capsys, ["analyze", "--text", "   ", "--out", str(tmp_path / "o")], "empty")


def test_missing_and_empty_file(no_model, capsys, tmp_path):
    _fails(capsys, ["analyze", "--file", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")], "not found")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    _fails(capsys, ["analyze", "--file", str(empty), "--out", str(tmp_path / "o")], "empty")
    assert not (tmp_path / "o" / "summary.json").exists()


def test_unwritable_out(no_model, capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    _fails(capsys, ["analyze", "--text", TEXT, "--out", str(blocker / "sub")], "cannot write", str(blocker))


def test_bad_options_before_load(no_model, capsys, tmp_path):
    _fails(capsys, ["analyze", "--stride", "4", "--out", str(tmp_path / "o")], "--stride needs --window")
    _fails(capsys, ["analyze", "--layers", "0,x", "--out", str(tmp_path / "o")], "--layers")
    _fails(capsys, ["analyze", "--window", "1", "--out", str(tmp_path / "o")], "--window")


def test_unknown_layer_and_head(tiny_llama_dir, capsys, tmp_path):
    out = tmp_path / "o"
    _fails(capsys, ["analyze", "--model", str(tiny_llama_dir), "--text", TEXT, "--layers", "0,7", "--out", str(out)],
           "layer 7 does not exist", "0..2")
    _fails(capsys, ["analyze", "--model", str(tiny_llama_dir), "--text", TEXT, "--heads", "9", "--out", str(out)],
           "head 9 does not exist")
    _fails(capsys, ["analyze", "--model", str(tiny_llama_dir), "--text", TEXT, "--figure-layers", "3", "--out", str(out)],
           "layer 3 does not exist")
    assert not (out / "tokens.parquet").exists()


def test_too_long_without_window(tiny_llama_dir, capsys, tmp_path):
    out = tmp_path / "o"
    _fails(capsys, ["analyze", "--model", str(tiny_llama_dir), "--out", str(out)], "handles at most 256", "--window")
    assert not (out / "tokens.parquet").exists()


# ------------------------------------------------------------------------------------------------
# The bundled model
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_short_text(smollm2, tmp_path):
    text = "Paris is the capital of France."
    out = tmp_path / "o"
    assert main(["analyze", "--text", text, "--layers", "0,15,29", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"]["name"] == "SmolLM2-135M-Instruct"
    assert summary["layers"] == [0, 15, 29]
    for l in (0, 15, 29):
        assert (out / f"maps_layer{l}.png").is_file()
    heads = pd.read_parquet(out / "heads.parquet").set_index(["layer", "head"])
    lt = analyze(smollm2, text, layers=[15]).layers[15]
    for h in range(lt.num_heads):
        assert heads.loc[(15, h), "sink_rate"] == pytest.approx(lt.attention[h, 1:, 0].mean(), abs=1e-5)
        assert heads.loc[(15, h), "sink_contribution"] == pytest.approx(lt.contribution[h, 1:, 0].mean(), abs=1e-4)


def _same_as_written(res, out, summary_keys):
    """``res``'s tables equal the Parquet files the command wrote into ``out``; its summary holds
    summary.json's keys (less the command's own, ``runtime_s`` and ``files``) with the same values,
    ``settings`` aside (the command records its run's, model and input identity included)."""
    import json

    import pandas as pd

    from attngeom.runs.storage import dumps

    for name, df in res.tables.items():
        pd.testing.assert_frame_equal(pd.read_parquet(out / f"{name}.parquet"), df, obj=name)
    written = json.loads((out / "summary.json").read_text())
    assert set(written) == set(res.summary) | {"runtime_s", "files"} and set(res.summary) >= set(summary_keys)
    assert sorted(f for f in written["files"] if f.endswith(".parquet")) == sorted(f"{n}.parquet" for n in res.tables)
    mine = json.loads(dumps(res.summary))
    assert written["settings"].items() >= mine.pop("settings").items()
    assert {k: written[k] for k in mine} == mine


def test_analysis_experiment_is_what_the_command_writes(tiny_llama_dir, tmp_path):
    """attngeom.analysis.experiment.experiment on a text in windows, and on a prompt with its answer
    (--generate), returns the tables attngeom analyze writes and summary.json's numbers; the
    per-window sums add up to the per-layer sinks of the summary."""
    from attngeom.analysis import experiment as analysis
    from attngeom import load_model
    from attngeom.cli import main
    from attngeom.errors import InputError
    from attngeom.generation.decoding import Decoding
    from attngeom.analysis.settings import AnalyzeSettings

    handle = load_model(str(tiny_llama_dir))
    text = "The cat sat on the mat; the dog lay by the door."
    out = tmp_path / "text"
    assert main(["analyze", "--model", str(tiny_llama_dir), "--text", text, "--layers", "0,2", "--figure-layers", "2",
                 "--window", "8", "--out", str(out), "--no-progress"]) == 0
    settings = AnalyzeSettings(layers=(0, 2), figure_layers=(2,), window=8)
    res = analysis.experiment(handle, InMemoryRun(), text, settings, source="--text")
    assert isinstance(res, ExperimentResult) and res.name == "analyze" and res.settings == settings.record()
    _same_as_written(res, out, ("model", "input", "per_layer", "top_tokens", "maps", "definitions"))
    pw = res.per_window
    W = res.summary["input"]["windows"]
    assert W > 2 and len(pw["ids"]) == W and pw["sink_attention"].shape == (W, 2)
    assert analysis.map_window(res) == pw["ids"][0]
    for j, row in enumerate(res.summary["per_layer"]):
        for k in ("sink_attention", "sink_contribution", "sink_contribution_to_layer_output"):
            assert pw[k][:, j].sum() / pw["queries"][:, j].sum() == pytest.approx(row[k], rel=1e-12, abs=1e-15)

    out = tmp_path / "generate"
    assert main(["analyze", "--model", str(tiny_llama_dir), "--text", "The cat sat", "--generate", "4",
                 "--out", str(out), "--no-progress"]) == 0
    res = analysis.experiment(handle, InMemoryRun(), "The cat sat", AnalyzeSettings(decoding=Decoding(4)), source="--text")
    assert {"answer_shares", "answer_sources", "answer_summary", "answer_heads"} <= set(res.tables)
    _same_as_written(res, out, ("generation",))
    with pytest.raises(InputError, match="windows do not apply"):
        analysis.experiment(handle, InMemoryRun(), "The cat sat", AnalyzeSettings(decoding=Decoding(4), window=8))

    data = tmp_path / "prompts.txt"
    data.write_text("The cat sat\na b c\n")
    out = tmp_path / "corpus"
    assert main(["analyze", "--model", str(tiny_llama_dir), "--data", str(data), "--generate", "2", "--out", str(out),
                 "--no-progress"]) == 0
    from attngeom.data.corpora import resolve_texts

    res = analysis.answer_experiment(handle, InMemoryRun(), resolve_texts(str(data), None),
                                     AnalyzeSettings(decoding=Decoding(2)), source=str(data))
    assert set(res.tables) == {"answers", "answer_shares", "answer_sources", "answer_summary", "answer_heads"}
    _same_as_written(res, out, ("prompts", "answer_tokens"))
