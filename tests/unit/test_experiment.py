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
    from attngeom.faithfulness import experiment as faithfulness
    from attngeom.heads import experiment as heads
    from attngeom.kvcache import experiment as kvcache
    from attngeom.selection import experiment as selection
    from attngeom.sinks import experiment as sinks
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
    """``experiment(handle, run, inputs, settings, *, options)`` in every analysis package's
    ``experiment`` module: ``run`` may be None (in memory), the inputs and the settings come next,
    anything else is keyword-only."""
    import importlib
    import inspect

    for name in ("faithfulness", "sinks", "selection", "heads", "kvcache", "claims", "analysis"):
        mod = importlib.import_module(f"attngeom.{name}.experiment")
        sig = inspect.signature(mod.experiment)
        params = list(sig.parameters.values())
        assert sig.return_annotation == "ExperimentResult", mod.__name__
        assert [p.name for p in params[:2]] == ["handle", "run"], mod.__name__
        assert params[0].annotation == "ModelHandleLike" and params[1].annotation.startswith("RunLike | None")
        names = [p.name for p in params]
        assert "settings" in names and names.index("settings") <= 3, mod.__name__
        assert all(p.kind is p.KEYWORD_ONLY for p in params[names.index("settings") + 1:]), mod.__name__


