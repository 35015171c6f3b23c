"""What every command relies on (issue 48, "commands are options, checks and one call"): a missing
command module fails at start-up; a report whose headline is missing fails loudly; each summary's
fields have one owner (the experiment module builds the summary and reads the headline back); each
settings dataclass gives its run's identity; the kvcache command's calibration is the head
experiment's taxonomy."""

from __future__ import annotations

import importlib

import pytest

from attngeom import cli
from attngeom.reports import run_report
from attngeom.runs.contract import ExperimentResult


def test_a_missing_command_module_fails_at_start_up(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", cli.COMMANDS + ("no_such_command",))
    with pytest.raises(ModuleNotFoundError, match="attngeom.commands.no_such_command"):
        cli.build_parser()


def test_every_command_is_on_the_command_line():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert set(sub.choices) == set(cli.COMMANDS)


def test_every_run_report_has_a_headline_beside_its_summary():
    """Every command that writes report.md through run_report (all but compare, whose report is its
    own) names a headline function, and that function lives where the summary is built."""
    assert set(cli.COMMANDS) - {"compare"} <= set(run_report.HEADLINES)
    for command, where in run_report.HEADLINES.items():
        module, name = where.split(":")
        assert callable(getattr(importlib.import_module(module), name)), where


@pytest.mark.parametrize("command", sorted(run_report.HEADLINES))
def test_a_report_whose_headline_is_missing_fails_loudly(command):
    with pytest.raises((KeyError, StopIteration, TypeError)):
        run_report.render(command, {"command": command, "model": "m"}, ["summary.json", "report.md"])


def test_a_report_of_an_unknown_command_or_an_empty_headline_fails():
    with pytest.raises(KeyError, match="no_such"):
        run_report.render("no_such", {"model": "m"}, [])
    with pytest.raises(ValueError, match="no headline"):
        run_report.render("kvcache", {"model": "m", "results": []}, [])


def _sinks_numbers() -> dict:
    return {"value_norm_ratio": 2.5, "anti_aligned_share": 0.25, "interior_minimum_share": 0.5, "ppl": 12.0,
            "removal_delta_ppl": 3.0, "control_delta_ppl": -0.5}


def test_sinks_summary_is_built_and_read_by_its_experiment_module():
    from attngeom.sinks.experiment import TABLES, headline, run_summary
    from attngeom.sinks.settings import SinksSettings

    res = ExperimentResult("sinks", summary=_sinks_numbers(), settings=SinksSettings(layers=(2, 0)).record())
    s = run_summary(res, [[1, 5, 6], [1, 7]], model="tiny", data="c.txt", window=3, identity={"k": 1})
    assert (s["windows"], s["tokens"], s["layers"], s["removal_layers"]) == (2, 5, [2, 0], "all")
    assert s["models"] == {"tiny": _sinks_numbers()} and s["files"] == [f"{t}.parquet" for t in TABLES]
    rows = dict(headline(s))
    assert rows["median value-norm ratio, non-sink / sink"] == "2.5"
    assert rows["heads whose sink value is anti-aligned with the semantic tokens"] == "25.0 %"
    assert rows["ΔPPL, sink removed"] == "+3" and rows["ΔPPL, mass-matched control removed"] == "-0.5"
    report = run_report.render("sinks", s, ["summary.json", "report.md"])
    assert "| heads with an interior minimum of the output norm in the sink rate | 50.0 % |" in report
    del s["models"]["tiny"]["ppl"]
    with pytest.raises(KeyError, match="ppl"):
        run_report.render("sinks", s, [])


def test_heads_and_selection_summaries_are_read_back_by_their_headlines():
    from attngeom.heads.experiment import headline as heads_headline, run_summary as heads_summary
    from attngeom.selection.experiment import headline as sel_headline, run_summary as sel_summary
    from attngeom.selection.settings import SelectionSettings

    res = ExperimentResult("heads", summary={"regime_share": {"a.txt": {"Retriever": 0.5, "Mixer": 0.25, "Reset": 0.25}},
                                             "taxonomy_regime_order": ["Mixer", "Reset", "Retriever"],
                                             "critical_heads": [{"layer": 0, "head": 1}]})
    rows = heads_headline(heads_summary(res, model="m", data=("a.txt",), window=8, identity={}))
    assert rows == [("regime shares, a.txt", "Retriever 50.0 %, Mixer 25.0 %, Reset 25.0 %"),
                    ("regime order chosen on calibration (first removed first)", "Mixer > Reset > Retriever"),
                    ("individually critical heads", "1")]
    st = SelectionSettings(ns=(1, 2), distances=("cosine",))
    res = ExperimentResult("selection", summary={"cosine": {"with_sink": {"f_topn": {1: 0.5, 2: 0.25},
                                                                          "f_random": {"1": 0.125, 2: 0.0}}},
                                                 "bound_violations": 0}, settings=st.record())
    s = sel_summary(res, [[1, 2, 3]], model="m", data="d", window=3, identity={})
    assert (s["ns"], s["distances"], s["layers"], s["tokens"]) == ([1, 2], ["cosine"], "all", 3)
    assert sel_headline(s) == [("F_N at N = 1 (cosine): top-N / random", "0.5 / 0.125"),
                               ("F_N at N = 2 (cosine): top-N / random", "0.25 / 0"), ("bound violations", "0")]


def test_settings_give_their_run_identity():
    """One way for every command: ``settings.identity()``: batching is no part of it, layer lists are
    sorted once each (None: "all"), and the options a command does not have are left out."""
    from attngeom.claims.settings import ClaimsSettings
    from attngeom.explorer.settings import ExploreSettings
    from attngeom.faithfulness.settings import FaithfulnessSettings
    from attngeom.generation.decoding import Decoding
    from attngeom.heads.settings import HeadsSettings
    from attngeom.kvcache.settings import KVCacheSettings, KVTaskSettings
    from attngeom.selection.settings import SelectionSettings
    from attngeom.sinks.settings import SinksSettings

    s = SinksSettings(layers=(3, 1, 1), removal_layers=None, batch_size=7).identity()
    assert s == {"sink": 0, "layers": [1, 3], "removal_layers": "all"}
    sel = SelectionSettings(layers=(2,), batch_size=5)
    assert sel.identity() == {"layers": [2], **sel.stats_options()}
    assert "batch_size" not in HeadsSettings().identity() and HeadsSettings().identity()["retentions"] == [100, 90, 75, 50, 25]
    assert "rows" not in FaithfulnessSettings(rows=3).identity()
    assert set(KVCacheSettings().identity()) == {"policies", "budgets", "chunk"}
    assert "n_resamples" not in KVTaskSettings().identity()
    assert "critical_k" not in ClaimsSettings().identity() and ClaimsSettings().identity()["bootstrap"] == 1000
    e = ExploreSettings()
    assert e.identity() == {"layers": "all", "top_k": 8, "exact_max_tokens": 512, "sink": 0}
    g = ExploreSettings(measure="alti", layers=(1,), decoding=Decoding(4), chat=True).identity()
    assert (g["measure"], g["layers"], g["generate"], g["chat"], g["system"]) == ("alti", [1], 4, True, None)


def test_kvcache_calibration_is_the_head_taxonomy(tiny_llama):
    """The kvcache command's calibration regimes (stage ``calibration``) are the head experiment's
    taxonomy of the same windows: TaxonomyStats streamed over them directly gives the same table."""
    from attngeom.heads.taxonomy import TaxonomyStats
    from attngeom.kvcache.experiment import calibration_regimes
    from attngeom.streaming.passes import stream

    windows = [tiny_llama.encode("The river winds through the valley, past old mills."),
               tiny_llama.encode("A small library stands at the corner of the square.")]
    got = calibration_regimes(tiny_llama, None, windows)
    tax = TaxonomyStats()
    stream(tiny_llama, windows, [tax], progress=False)
    want = tax.result()[["layer", "head", "regime"]]
    assert list(got.columns) == ["layer", "head", "regime"]
    assert got.reset_index(drop=True).equals(want.reset_index(drop=True))
