"""attngeom.runs.contract: the one perplexity rule, and the one result shape of every experiment."""

import math

import numpy as np
import pytest

from attngeom.stats import resampling as bs
from attngeom.runs.contract import ExperimentResult, ModelHandleLike, RunLike, perplexity
from attngeom.runs.run import InMemoryRun
from attngeom.faithfulness.settings import FaithfulnessSettings
from attngeom.heads.settings import HeadsSettings
from attngeom.kvcache.settings import KVCacheSettings
from attngeom.selection.settings import SelectionSettings
from attngeom.sinks.settings import SinksSettings


def test_perplexity_scalar_array_and_zero_tokens():
    assert perplexity(6.0, 3) == math.exp(2.0)
    assert isinstance(perplexity(np.float64(6.0), np.int64(3)), float)
    assert math.isnan(perplexity(0.0, 0)) and math.isnan(perplexity(5.0, 0))
    got = perplexity(np.array([[6.0, 1.0], [0.0, 2.0]]), np.array([[3.0, 1.0], [0.0, 4.0]]))
    assert got[0, 0] == pytest.approx(math.exp(2.0), rel=1e-15) and got[0, 1] == pytest.approx(math.e, rel=1e-15)
    assert np.isnan(got[1, 0]) and got[1, 1] == pytest.approx(math.exp(0.5), rel=1e-15)


def test_resampled_perplexity_follows_the_same_rule():
    nll = np.array([[4.0], [9.0]])
    tok = np.array([0.0, 3.0])
    counts = np.array([[2, 0], [1, 1]])
    got = bs.resampled_perplexity(counts, nll, tok)
    assert np.isnan(got[0, 0])                                   # the resample holds no token
    assert got[1, 0] == pytest.approx(math.exp(13.0 / 3.0), rel=1e-15)


def test_memory_run_and_a_handle_satisfy_the_protocols():
    from tiny_models import tiny_model

    assert isinstance(InMemoryRun(), RunLike)
    assert isinstance(tiny_model("llama"), ModelHandleLike)
    r = ExperimentResult("x")
    assert r.tables == {} and r.summary == {} and r.per_window == {}


def test_every_experiment_returns_one_shape_whose_per_window_sums_give_its_tables():
    """heads, sinks, selection, faithfulness and kvcache return an ExperimentResult; the per-window sums a
    bootstrap resamples add up to the experiment's own tables (the claims read nothing else)."""
    from attngeom.faithfulness import curves as faithfulness
    from attngeom.heads import removal as heads
    from attngeom import kvcache
    from attngeom import selection
    from attngeom import sinks
    from attngeom.runs.contract import perplexity as ppl
    from tiny_models import tiny_model

    h = tiny_model("llama")
    rng = np.random.default_rng(0)
    ids = [[int(x) for x in rng.integers(1, h.model.config.vocab_size, 12)] for _ in range(4)]

    res = heads.experiment(h, InMemoryRun(), [ids], HeadsSettings(calib_windows=2, retentions=(100.0, 50.0), batch_size=1))
    assert isinstance(res, ExperimentResult) and set(res.tables) >= {"heads", "removal", "taxonomy_calibration"}
    rem = res.per_window["removal"]
    assert rem["nll"].shape == (len(rem["keys"]), 2)
    table = res.tables["removal"].set_index(["order", "retention"])["ppl"]
    for k, row in zip(rem["keys"], rem["nll"]):
        if k[0]:
            assert table[k] == ppl(row.sum(), rem["tokens"].sum())
    tax = res.per_window["taxonomy"]
    assert len(tax) == 4
    base = ppl(sum(t["nll"] for t in tax[:2]), sum(t["tokens"] for t in tax[:2]))
    sens = np.array([ppl(r.sum(), sum(t["tokens"] for t in tax[:2])) - base for r in res.per_window["sensitivity"]])
    assert np.allclose(sens, res.tables["heads"].sort_values(["layer", "head"])["single_delta_ppl"], rtol=1e-12)

    res = sinks.experiment(h, InMemoryRun(), ids, SinksSettings(batch_size=1))
    recs = res.per_window["records"]
    pp = res.tables["ppl"].set_index("pass")
    assert len(recs) == 4 and pp.loc["none", "nll"] == pytest.approx(sum(r["nll"]["none"] for r in recs), rel=1e-12)
    assert "records" not in sinks.experiment(h, None, ids).per_window   # run None: in memory; batched (2 per record): no records

    res = selection.experiment(h, InMemoryRun(), ids, SelectionSettings(ns=(2,), repeats=1, predict=False, batch_size=1))
    assert set(res.tables) == {"selection", "regime"} and set(res.tables["selection"]["window"]) == {0, 1, 2, 3}

    settings = FaithfulnessSettings(metrics=("attention",), ratios=(0.5,))
    res = faithfulness.experiment(h, None, faithfulness.window_units(ids), settings, progress=False)
    assert [v.key for v in res.per_window["variants"]] == [v.key for v in faithfulness.variants_of(settings)]
    clean = res.tables["table"]["clean"].iloc[0]
    assert clean == ppl(res.per_window["nll"][:, 0].sum(), res.per_window["tokens"].sum())

    res = kvcache.experiment(h, InMemoryRun(), ids, KVCacheSettings(policies=("full", "window"), budgets=(6,), n_resamples=50))
    assert isinstance(res, ExperimentResult) and set(res.tables) == {"reads", "summary", "pairs"}
    pw, summary = res.per_window, res.tables["summary"].set_index(["policy", "budget"])["ppl"]
    assert pw["nll"].shape == (4, 2) and list(pw["tokens"]) == [11] * 4
    for k, col in zip(pw["keys"], pw["nll"].T):
        assert summary[k] == pytest.approx(ppl(col.sum(), pw["tokens"].sum()), rel=1e-12)
    assert res.settings["policies"] == ("full", "window") and res.settings["n_resamples"] == 50


def test_every_experiment_has_the_contract_signature():
    import inspect

    from attngeom import analysis, claims, faithfulness, heads, kvcache, selection, sinks

    """``experiment(handle, run, inputs, settings, *, options)`` everywhere: ``run`` may be None (in
    memory), the inputs and the settings come next, anything else is keyword-only."""
    for mod in (faithfulness, sinks, selection, heads, kvcache, claims, analysis):
        sig = inspect.signature(mod.experiment)
        params = list(sig.parameters.values())
        assert sig.return_annotation == "ExperimentResult", mod.__name__
        assert [p.name for p in params[:2]] == ["handle", "run"], mod.__name__
        assert params[0].annotation == "ModelHandleLike" and params[1].annotation.startswith("RunLike | None")
        names = [p.name for p in params]
        assert "settings" in names and names.index("settings") <= 3, mod.__name__
        assert all(p.kind is p.KEYWORD_ONLY for p in params[names.index("settings") + 1:]), mod.__name__


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
    """attngeom.analysis.single_text.experiment on a text in windows, and on a prompt with its answer
    (--generate), returns the tables attngeom analyze writes and summary.json's numbers; the
    per-window sums add up to the per-layer sinks of the summary."""
    from attngeom.analysis import single_text as analysis
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
