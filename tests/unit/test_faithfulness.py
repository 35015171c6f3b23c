"""The faithfulness experiment: PPL and task accuracy under interventions, resume, CLI and bad input."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from attngeom.capture.session import Session
from attngeom.errors import InputError
from attngeom.faithfulness import experiment as F
from attngeom.faithfulness.experiment import CLEAN, build_variants, experiment, run_units, summarize, task_units, window_units
from attngeom.capture.interventions import RankIntervention, Variant
from attngeom.streaming.reducers import InputBatch
from attngeom.runs.run import Run
from attngeom.faithfulness.settings import FaithfulnessSettings
from attngeom.faithfulness.tasks import load_task
from attngeom.streaming import forward
from checks import write_jsonl as _write

TEXT = ("The cat sat on the mat. A dog ran to the park and back again, then slept by the door. "
        "Rain fell all night; in the morning the streets were wet and quiet.")


def _windows(handle, n=3, window=24):
    from attngeom.data.corpora import windows
    ids = handle.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    return windows(ids, window, bos=handle.tokenizer.bos_token_id, max_windows=n)


def _settings(**kw):
    return FaithfulnessSettings(metrics=("attention", "contribution", "random"), ratios=(0.3, 0.7), seeds=(0, 1), **kw)


def _variants():
    return F.variants_of(_settings())


def _run(out, **settings):
    return Run(out, "faithfulness", {"test": True, **settings}, progress=False)


# --------------------------------------------------------------------------------------------
# Perplexity
# --------------------------------------------------------------------------------------------


def _table_summary(*args, **kw):
    """The faithfulness experiment's table and summary (its ExperimentResult's)."""
    res = experiment(*args, **kw)
    return res.tables["table"], res.summary


def test_clean_ppl_equals_plain_model(tiny_llama, tmp_path):
    wins = _windows(tiny_llama)
    res = experiment(tiny_llama, _run(tmp_path), units=window_units(wins), settings=_settings(), progress=False)
    table, summary = res.tables["table"], res.summary
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in wins:
            ids = torch.tensor(w)[None]
            logits = tiny_llama.model(input_ids=ids, use_cache=False).logits.double()
            lp = torch.log_softmax(logits[0, :-1], -1)
            nll -= float(lp.gather(-1, ids[0, 1:, None]).sum())
            n += len(w) - 1
    assert summary["clean"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    # the per-window records a bootstrap resamples: column 0 is the clean forward, they add up to the table
    pw = res.per_window
    assert pw["windows"] == list(range(len(wins))) and pw["nll"].shape == (len(wins), len(_variants()))
    assert pw["nll"][:, 0].sum() == pytest.approx(nll, rel=1e-5) and pw["tokens"].sum() == n
    assert set(table["metric"]) == {"attention", "contribution", "random"}
    assert len(table) == 2 * 2 * 2 + 2 * 2 * 2  # 2 metrics x 2 modes x 2 ratios, random x 2 seeds
    assert (table["tokens"] == n).all()
    # change = PPL' - PPL; one row recomputed by hand from a single intervened forward per window
    v = Variant("contribution", "sufficiency", 0.7)
    nll = 0.0
    for u, w in enumerate(wins):
        b = InputBatch(ids=torch.tensor(w)[None], lengths=torch.tensor([len(w)]), index=[0])
        lg = forward(tiny_llama, b, Session(intervention=RankIntervention(v, salts=[u])), logits=True).double()
        nll -= float(torch.log_softmax(lg[0, :-1], -1).gather(-1, b.ids[0, 1:, None]).sum())
    row = table[(table.metric == "contribution") & (table["mode"] == "sufficiency") & (table.ratio == 0.7)].iloc[0]
    assert row["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert row["change"] == pytest.approx(row["ppl"] - summary["clean"], rel=1e-9)
    assert list((tmp_path / "checkpoint").glob("records-*.jsonl"))
    s = summary
    for m in ("attention", "contribution", "random"):
        d = s["metrics"][m]
        g = table[(table.metric == m)]
        assert d["comprehensiveness_aoc"] == pytest.approx(g[g["mode"] == "comprehensiveness"]["change"].mean())
        assert d["sufficiency_aoc"] == pytest.approx(g[g["mode"] == "sufficiency"]["change"].mean())
    assert s["order_comprehensiveness"] == sorted(s["metrics"], key=lambda m: -s["metrics"][m]["comprehensiveness_aoc"])
    assert s["order_sufficiency"] == sorted(s["metrics"], key=lambda m: s["metrics"][m]["sufficiency_aoc"])
    assert s["complete"] and s["units_done"] == len(wins)


def test_batched_rows_equal_one_variant_per_forward(tiny_llama):
    units = window_units(_windows(tiny_llama, n=2))
    variants = _variants()
    many = run_units(tiny_llama, units, variants, rows=len(variants), progress=False)
    one = run_units(tiny_llama, units, variants, rows=1, progress=False)
    assert many.keys() == one.keys()
    for k in many:
        assert many[k]["nll"] == pytest.approx(one[k]["nll"], rel=1e-5, abs=1e-4)


def test_resume_after_a_kill_gives_the_same_table(tiny_llama, tmp_path, monkeypatch):
    units = window_units(_windows(tiny_llama, n=4))
    full, full_s = _table_summary(tiny_llama, _run(tmp_path / "full"), units=units, settings=_settings(rows=5),
                                  progress=False)

    class Killed(Exception):
        pass

    real = F.pair_nll
    calls = []

    def dies_after(n):
        def pair_nll(handle, unit, chunk, layers, *prepared):
            if len(calls) == n:
                raise Killed
            calls.append(unit.salt)
            return real(handle, unit, chunk, layers, *prepared)
        return pair_nll

    monkeypatch.setattr(F, "pair_nll", dies_after(5))  # 4 forwards per window (17 variants, 5 rows)
    with pytest.raises(Killed):
        experiment(tiny_llama, _run(tmp_path / "part"), units=units, settings=_settings(rows=5), progress=False)
    # a kill in the middle of a write leaves a cut line: it is ignored and redone
    log = next((tmp_path / "part" / "checkpoint").glob("records-*.jsonl"))
    assert len(log.read_text().splitlines()) == 5
    with log.open("a") as f:
        f.write('{"stage": "faithfulness", "units": [15, 16], "da')
    calls.clear()
    monkeypatch.setattr(F, "pair_nll", dies_after(10**9))
    part, part_s = _table_summary(tiny_llama, _run(tmp_path / "part"), units=units, settings=_settings(rows=5),
                                  progress=False)
    assert len(calls) == 4 * 4 - 5  # finished forwards were skipped
    pd.testing.assert_frame_equal(part, full)
    for k in ("clean", "metrics", "order_comprehensiveness", "order_sufficiency", "units_done"):
        assert part_s[k] == full_s[k]
    # a rerun of a finished run computes nothing
    calls.clear()
    again, _ = _table_summary(tiny_llama, _run(tmp_path / "part"), units=units, settings=_settings(), progress=False)
    assert calls == []
    pd.testing.assert_frame_equal(again, full)


def test_partial_results_use_only_finished_windows(tiny_llama, tmp_path, monkeypatch):
    units = window_units(_windows(tiny_llama, n=3))
    variants = _variants()
    run = _run(tmp_path)
    run_units(tiny_llama, units[:2], variants, rows=len(variants), progress=False, run=run)  # windows 0 and 1 only
    results = run_units(tiny_llama, units, variants, rows=len(variants), progress=False, run=_run(tmp_path))
    assert F.complete_units(results, 3, variants) == [0, 1, 2]
    table = F.ppl_table(results, [0, 1], variants)
    assert (table["units"] == 2).all() and (table["tokens"] == sum(u.n_scored for u in units[:2])).all()


def test_summary_orders_and_random_seeds():
    rows = []
    for m, c, s in (("a", 1.0, 0.5), ("b", 3.0, 0.1), ("random", 2.0, 2.0)):
        for mode, x in (("comprehensiveness", c), ("sufficiency", s)):
            for r in (0.2, 0.4):
                for seed in ((0, 1) if m == "random" else (None,)):
                    bump = 0.0 if seed in (None, 0) else 1.0
                    rows.append(dict(metric=m, mode=mode, ratio=r, seed=seed, ppl=10 + x + bump, clean=10.0,
                                     change=x + bump, tokens=5, units=1))
    s = summarize(pd.DataFrame(rows))
    assert s["order_comprehensiveness"] == ["b", "random", "a"]
    assert s["order_sufficiency"] == ["b", "a", "random"]
    assert s["metrics"]["random"]["comprehensiveness_aoc"] == pytest.approx(2.5)
    assert s["metrics"]["random"]["comprehensiveness_aoc_per_seed"] == {"0": 2.0, "1": 3.0}
    acc = summarize(pd.DataFrame(rows).assign(change=lambda d: -d["change"]), measure="accuracy")
    assert acc["order_comprehensiveness"] == ["b", "random", "a"]  # biggest accuracy drop first


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------


MMLU = [{"question": "What is 2+2?", "choices": ["3", "4", "5", "22"], "answer": 1},
        {"question": "Color of the sky?", "choices": ["blue", "green"], "answer": "0"},
        {"question": "Pick C", "choices": ["a", "b", "c"], "answer": "C"}]
WINO = [{"sentence": "The trophy did not fit in the case because _ was too big.", "option1": "the trophy",
         "option2": "the case", "answer": "1"},
        {"sentence": "Ann gave Bea a gift because _ was kind.", "option1": "Ann", "option2": "Bea", "answer": 2}]
BOOLQ = [{"passage": "Cats are mammals.", "question": "are cats mammals", "answer": True},
         {"passage": "The sun is cold.", "question": "is the sun hot", "answer": "false"}]


def _slow_logliks(handle, examples):
    """Independent path: each option alone through the plain model, summed log-probs of its continuation."""
    out = {}
    for e, ex in enumerate(examples):
        for k, (ctx, cont) in enumerate(ex.options):
            c = [handle.tokenizer.bos_token_id] + handle.tokenizer(ctx, add_special_tokens=False)["input_ids"]
            t = handle.tokenizer(cont, add_special_tokens=False)["input_ids"]
            ids = torch.tensor(c + t)[None]
            with torch.no_grad():
                lp = torch.log_softmax(handle.model(input_ids=ids, use_cache=False).logits[0].double(), -1)
            out[(e, k)] = sum(float(lp[len(c) - 1 + n, tok]) for n, tok in enumerate(t))
    return out


@pytest.mark.parametrize("task,rows", [("mmlu", MMLU), ("winogrande", WINO), ("boolq", BOOLQ)])
def test_task_accuracy_matches_slow_path(tiny_llama, tmp_path, task, rows):
    examples = load_task(_write(tmp_path / f"{task}.jsonl", rows), task)
    assert [ex.answer for ex in examples] == {"mmlu": [1, 0, 2], "winogrande": [0, 1], "boolq": [1, 0]}[task]
    units = task_units(tiny_llama, examples)
    settings = FaithfulnessSettings(metrics=("contribution", "random"), ratios=(0.5,), seeds=(0,), rows=3)
    variants = F.variants_of(settings)
    table, summary = _table_summary(tiny_llama, _run(tmp_path / "out"), units=units, settings=settings,
                                    examples=examples, progress=False)
    slow = _slow_logliks(tiny_llama, examples)
    results = run_units(tiny_llama, units, variants, rows=3, progress=False, run=_run(tmp_path / "out"))
    for i, tu in enumerate(units):
        assert -results[(i, "clean")]["nll"] == pytest.approx(slow[(tu.example, tu.option)], rel=1e-4, abs=1e-4)
    pred = [max(range(len(ex.options)), key=lambda k: (slow[(e, k)], -k)) for e, ex in enumerate(examples)]
    acc = sum(p == ex.answer for p, ex in zip(pred, examples)) / len(examples)
    assert summary["clean"] == pytest.approx(acc)
    assert summary["measure"] == "accuracy" and summary["units_done"] == len(examples)
    # intervened: each option alone under the same ranking gives the batched log-likelihood
    v = Variant("contribution", "comprehensiveness", 0.5)
    for i, tu in enumerate(units):
        b = InputBatch(ids=torch.tensor(tu.ids)[None], lengths=torch.tensor([len(tu.ids)]), index=[0])
        lg = forward(tiny_llama, b, Session(intervention=RankIntervention(v, salts=[tu.salt])), logits=True)[0].double()
        lp = torch.log_softmax(lg, -1)
        T = len(tu.ids)
        ll = sum(float(lp[T - 1 - tu.n_scored + n, tu.ids[T - tu.n_scored + n]]) for n in range(tu.n_scored))
        assert -results[(i, v.key)]["nll"] == pytest.approx(ll, rel=1e-4, abs=1e-4)
    row = table[(table.metric == "contribution") & (table["mode"] == "comprehensiveness")].iloc[0]
    assert row["change"] == pytest.approx(row["accuracy"] - summary["clean"])


@pytest.mark.parametrize("task,row,msg", [
    ("mmlu", {"question": "q", "choices": ["a", "b"], "answer": 2}, "out of range"),
    ("mmlu", {"question": "q", "choices": ["a", "b"]}, "field 'answer' is missing"),
    ("winogrande", {"sentence": "x _ y", "option1": "a", "option2": "b", "answer": "3"}, "out of range"),
    ("winogrande", {"sentence": "no blank", "option1": "a", "option2": "b", "answer": "1"}, "blank"),
    ("boolq", {"passage": "p", "question": "q", "answer": "maybe"}, "true or false"),
    ("boolq", {"passage": "p", "answer": True}, "field 'question' is missing"),
])
def test_bad_task_files(tmp_path, task, row, msg):
    path = _write(tmp_path / "t.jsonl", [row])
    with pytest.raises(InputError, match=msg):
        load_task(path, task)


def test_bad_variant_lists():
    with pytest.raises(InputError, match="outside"):
        build_variants(["attention"], [0.0, 0.5])
    with pytest.raises(InputError, match="outside"):
        build_variants(["attention"], [1.0])
    with pytest.raises(InputError, match="unknown metric 'attn'"):
        build_variants(["attn"], [0.5])
    v = build_variants(["attention", "random"], [0.5], seeds=[0, 1, 2])
    assert v[0] == CLEAN and len(v) == 1 + 2 + 2 * 3


# --------------------------------------------------------------------------------------------
# The command line (tiny model saved as a local model directory)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content,msg", [
    (b'{"question": "q", "choices": ["a", "b"], "answer": 0}\n[1, 2]\n', ":2: expected a JSON object, got an array"),
    (b'{"question": "q", "choices": ["a", "b"], "answer": 0}\n7\n', ":2: expected a JSON object, got a number"),
    (b'{"question": "q\x01"}\n', ":1: not valid JSON at column"),
    (b'{"question": "\xff"}\n', ":1: not UTF-8 text"),
])
def test_task_file_lines_are_checked(tmp_path, content, msg):
    p = tmp_path / "t.jsonl"
    p.write_bytes(content)
    with pytest.raises(InputError, match=msg) as e:
        load_task(p, "mmlu")
    assert not str(e.value).endswith(" at") and not str(e.value).endswith("at)")
