"""Two traces compared (attngeom.traces.compare, attngeom compare): the alignment rule, the
differences against the traces' own maps, two models, one-line refusals and the command."""

import json

import numpy as np
import pandas as pd
import pytest

from attngeom.cli import main
from attngeom.errors import InputError
from attngeom.traces.compare import align, diff
from attngeom.traces.trace import Trace, analyze
from tiny_models import tiny_model

A, B = "the cat sat on the mat", "the cow sat on the mat"     # one token per character: "at" vs "ow"


@pytest.fixture(scope="module")
def pair(tiny_llama):
    return analyze(tiny_llama, A), analyze(tiny_llama, B)


def test_alignment_rule():
    al = align(["<s>", "a", "b", "c", "d"], ["<s>", "a", "x", "y", "c", "d"])
    assert al["op"].tolist() == ["equal", "equal", "replace", "replace", "replace", "equal", "equal"]
    assert al["position_a"].tolist()[:3] == [0, 1, 2] and pd.isna(al["position_a"][3])
    eq = al[al["op"] == "equal"]
    assert list(zip(eq["position_a"], eq["position_b"])) == [(0, 0), (1, 1), (3, 4), (4, 5)]
    ins = align(["a", "b"], ["a", "z", "b"])
    assert ins["op"].tolist() == ["equal", "insert", "equal"]
    same = align(list("abc"), list("abc"))
    assert (same["op"] == "equal").all() and (same["position_a"] == same["position_b"]).all()


def test_differences_equal_the_traces_maps(pair):
    a, b = pair
    d = diff(a, b)
    assert d.target_a == d.target_b == len(a) - 1
    pairs = d.pairs
    changed = [i for i in range(len(a)) if i not in set(pairs[:, 0])]
    assert [a.tokens[i] for i in changed] == ["a", "t"] and len(pairs) == len(a) - 2
    i = len(a) - 1
    for la, lb in zip(a.layers, b.layers):
        for m in ("attention", "contribution"):
            x = la.attention if m == "attention" else la.contribution_inter
            y = lb.attention if m == "attention" else lb.contribution_inter
            ra = x[:, i].mean(0) if m == "attention" else x[:, i].sum(0)
            rb = y[:, i].mean(0) if m == "attention" else y[:, i].sum(0)
            # ½ L1 over the union of sources, a changed source against zero
            want = (np.abs(rb[pairs[:, 1]] - ra[pairs[:, 0]]).sum() + np.abs(ra[changed]).sum()
                    + np.abs(rb[changed]).sum()) / 2
            row = d.layers[(d.layers["layer"] == la.index) & (d.layers["measure"] == m)].iloc[0]
            assert abs(row["distance"] - want) < 1e-6 and abs(row["changed_share_a"] - ra[changed].sum()) < 1e-6
            src = d.sources[(d.sources["layer"] == la.index) & (d.sources["op"] == "equal")]
            assert np.allclose(src[f"{m}_diff"], rb[pairs[:, 1]] - ra[pairs[:, 0]], atol=1e-6)
        heads = d.heads[d.heads["layer"] == la.index]
        assert np.allclose(heads["head_share_a"], la.contribution_inter[:, i].sum(-1), atol=1e-6)
        assert np.allclose(heads["sink_rate_b"], lb.attention[:, i, 0], atol=1e-7)
        assert np.all((heads["attention_distance"] >= 0) & (heads["attention_distance"] <= 1 + 1e-6))
        full = d.map_diff(la.index, "contribution", head=1)
        eq = (d.alignment["op"] == "equal").to_numpy()
        assert list(full.index) == list(full.columns) and len(full) == len(d.alignment)
        assert np.allclose(full.to_numpy()[np.ix_(eq, eq)], lb.contribution_inter[1][np.ix_(pairs[:, 1], pairs[:, 1])]
                           - la.contribution_inter[1][np.ix_(pairs[:, 0], pairs[:, 0])], atol=1e-6)
        for k, (pa_, pb_) in enumerate(zip(d.alignment["position_a"], d.alignment["position_b"])):
            if pd.isna(pa_):                      # a token only in b: its column holds b's values
                assert full.columns[k].startswith(f"b{pb_} ")
                rows_b = [j for j, x in enumerate(d.alignment["position_b"]) if not pd.isna(x)]
                want = lb.contribution_inter[1][[int(d.alignment["position_b"][j]) for j in rows_b], int(pb_)]
                assert np.allclose(full.to_numpy()[rows_b, k], want, atol=1e-6)
            elif pd.isna(pb_):                    # only in a: a's values negated
                assert full.columns[k].startswith(f"a{pa_} ")


def test_a_trace_against_itself_differs_nowhere(pair):
    a, _ = pair
    d = diff(a, a, target=5)
    assert (d.target_a, d.target_b) == (5, 5)
    assert np.allclose(d.layers["distance"], 0) and np.allclose(d.heads["contribution_distance"], 0)
    assert np.allclose(d.map_diff(0).to_numpy(), 0)
    assert "0 changed in a" in repr(d) and "\n" not in repr(d)


def test_two_models_on_one_text(tiny_llama):
    other = tiny_model("llama", seed=1)          # a second model: other weights than the shared one
    a, b = analyze(tiny_llama, A), analyze(other, A)
    d = diff(a, b)
    assert len(d.pairs) == len(a) and (d.layers["distance"] > 0).all()
    assert d.summary()["changed_a"] == d.summary()["changed_b"] == 0
    fewer = analyze(tiny_model("llama", seed=2, num_attention_heads=2, num_key_value_heads=1), A)
    d2 = diff(a, fewer)
    assert d2.heads.empty and len(d2.layers) == 2 * 3          # token level only when the heads differ
    with pytest.raises(InputError, match="cannot be compared"):
        d2.map_diff(0, head=0)


def test_refusals_are_one_line(pair):
    a, b = pair
    other = Trace(ids=a.ids, tokens=[f"x{t}" for t in a.tokens], layers=a.layers, model_name="other")
    for call, match in [(lambda: diff(a, other), "only 0 of trace a's"),
                        (lambda: diff(a, b, target=6), "no counterpart"),       # the changed 'a' of "cat"
                        (lambda: diff(a, b, target=99), "outside"),
                        (lambda: diff(Trace(a.ids, a.tokens, a.layers.values()[:1]), Trace(b.ids, b.tokens, b.layers.values()[1:])),
                         "no layer in common"),
                        (lambda: diff(a, b).map_diff(7), "not in both")]:
        with pytest.raises(InputError, match=match) as e:
            call()
        assert "\n" not in str(e.value)


def test_compare_command(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["compare", "--model", str(tiny_llama_dir), "--text", A, "--text-b", B, "--out", str(out)]
    assert main(argv) == 0
    files = json.loads((out / "summary.json").read_text())["files"]
    assert set(files) == {"alignment.parquet", "layers.parquet", "heads.parquet", "sources.parquet", "compare.html",
                          "summary.json", "report.md"}
    layers = pd.read_parquet(out / "layers.parquet")
    from attngeom import load_model

    h = load_model(str(tiny_llama_dir))
    want = diff(analyze(h, A), analyze(h, B)).layers
    assert np.allclose(layers["distance"], want["distance"], atol=1e-6)
    report = (out / "report.md").read_text()
    assert "2 changed in a, 2 in b" in report and "Heads whose contribution rows" in report
    page = (out / "compare.html").read_text()
    assert page.count("<iframe") == 2 and "<script id=" not in page.split("<iframe")[0]
    assert main(argv) == 0 and "already holds this complete run" in capsys.readouterr().err
    # two models on one text
    assert main(["compare", "--model", str(tiny_llama_dir), "--model-b", str(tiny_llama_dir), "--text", A,
                 "--out", str(tmp_path / "m")]) == 0


@pytest.mark.parametrize("extra, match", [
    ([], "nothing to compare"),
    (["--text-b", "   "], "--text is empty"),
    (["--text-b", "zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz"], "only"),
    (["--text-b", B, "--layers", "9"], "layer 9 does not exist"),
    (["--text-b", B, "--target", "6"], "no counterpart"),
])
def test_compare_command_refuses_bad_input(tiny_llama_dir, tmp_path, capsys, extra, match):
    out = tmp_path / "o"
    assert main(["compare", "--model", str(tiny_llama_dir), "--text", A, *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert match in err[-1] and err[-1].startswith("attngeom compare: error:")
    assert not (out / "summary.json").exists() and not (out / "compare.html").exists()
