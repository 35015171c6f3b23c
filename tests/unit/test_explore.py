"""The explorer's data (attngeom.explorer.data), its HTML (attngeom.reports.explore) and ``attngeom explore``.
The browser side is tests/integration/test_explore_browser.py."""

from __future__ import annotations

import base64
import json
import re
import zlib

import numpy as np
import pytest
import torch

from attngeom import analyze
from attngeom.explorer import data as E
from attngeom.cli import main
from attngeom.metrics import registry
from attngeom.reports import explore as R

TEXT = "The cat sat on the mat; the dog lay by the door."


@pytest.fixture(scope="module")
def ids(tiny_llama):
    return tiny_llama.encode(TEXT)


@pytest.fixture(scope="module")
def exact(tiny_llama, ids):
    return E.build(tiny_llama, ids)


@pytest.fixture(scope="module")
def trace(tiny_llama, ids):
    return analyze(tiny_llama, ids)


# ------------------------------------------------------------------------------------------------
# Contribution flow: a case computed by hand
# ------------------------------------------------------------------------------------------------


def test_flow_by_hand():
    """T = 3, two layers. Layer 0: r = (1, 0.5, 0.25), token-level C rows
    C_0 = (1, 0, 0), C_1 = (0.4, 0.6, 0), C_2 = (0.5, -0.5, 1.0).
    Layer 1: r = (1, 0.5, 0.5), C_2 = (0.2, 0.3, 0.5), C_1 = (1, 0, 0).

    A_ij = r_i δ_ij + (1 - r_i) C_ij:
    layer 1, row 2: (0.1, 0.15, 0.5 + 0.25) = (0.1, 0.15, 0.75).
    layer 0: row 0 = (1, 0, 0); row 1 = (0.2, 0.5 + 0.3, 0) = (0.2, 0.8, 0);
             row 2 = (0.375, -0.375, 0.25 + 0.75) = (0.375, -0.375, 1.0).
    From token 2: after layer 1: (0, 0, 1); before layer 1: (0.1, 0.15, 0.75);
    before layer 0: 0.1*(1,0,0) + 0.15*(0.2,0.8,0) + 0.75*(0.375,-0.375,1)
                  = (0.1 + 0.03 + 0.28125, 0.12 - 0.28125, 0.75) = (0.41125, -0.16125, 0.75)."""
    def rows(r, C):
        out = []
        for i in range(3):
            row = {j: (1 - r[i]) * c for j, c in C[i].items()}
            row[i] = row.get(i, 0.0) + r[i]
            out.append(row)
        return out

    A0 = rows([1, 0.5, 0.25], [{0: 1.0}, {0: 0.4, 1: 0.6}, {0: 0.5, 1: -0.5, 2: 1.0}])
    A1 = rows([1, 0.5, 0.5], [{0: 1.0}, {0: 1.0}, {0: 0.2, 1: 0.3, 2: 0.5}])
    f = E.flow([A0, A1], token=2, T=3)
    np.testing.assert_allclose(f[2], [0, 0, 1])
    np.testing.assert_allclose(f[1], [0.1, 0.15, 0.75])
    np.testing.assert_allclose(f[0], [0.41125, -0.16125, 0.75])
    np.testing.assert_allclose(f.sum(1), 1.0)


def test_flow_of_the_model_sums_to_one(exact):
    T = exact.T
    transfers = [exact.transfer_rows(l) for l in exact.layers]
    for t in (0, T // 2, T - 1):
        f = E.flow(transfers, t, T)
        np.testing.assert_allclose(f.sum(1), 1.0, atol=5e-3)  # float16 rows
        assert np.all(f[:, t + 1:] == 0)                        # causal: nothing from later tokens


def test_residual_share_is_the_projection(tiny_llama, ids):
    """r_i = <y_i, x_i>/|y_i|^2 with x the layer input (the hidden state the model returns) and
    y = x + the layer's attention output, recomputed here outside the capture."""
    data = E.build(tiny_llama, ids)
    model = tiny_llama.model
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    dec = tiny_llama.adapter.decoder_layers
    for k, l in enumerate(data.layers):
        x = hs[l][0].double()
        with torch.no_grad():
            layer = dec[l]
            pos = torch.arange(len(ids))[None]
            emb = model.model.rotary_emb(hs[l], pos)
            attn_out = layer.self_attn(layer.input_layernorm(hs[l]), position_embeddings=emb,
                                       attention_mask=None)[0][0].double()
        y = x + attn_out
        r = ((y * x).sum(-1) / (y * y).sum(-1)).numpy()
        np.testing.assert_allclose(data.residual_share[k], r, atol=2e-3)


# ------------------------------------------------------------------------------------------------
# Rows: exact maps equal the trace, top-k rows are the top of the exact rows
# ------------------------------------------------------------------------------------------------


def test_exact_rows_equal_the_trace(exact, trace):
    assert exact.exact and exact.T == len(trace.ids)
    H = exact.num_heads
    for k, lt in enumerate(trace.layers):
        att, con = exact.rows["attention"][k].astype(np.float32), exact.rows["contribution"][k].astype(np.float32)
        np.testing.assert_allclose(att[:H], lt.attention, atol=1e-3)
        np.testing.assert_allclose(con[:H], lt.contribution, atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(att[H], lt.attention.mean(0), atol=1e-3)
        np.testing.assert_allclose(con[H], lt.contribution_inter.sum(0), atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(con[H].sum(-1), 1.0, atol=1e-2)   # Σ_j C_ij = 1


def test_top_source_matches_the_maps(exact, trace):
    lt = trace.layers.values()[-1]
    q = exact.T - 1
    j = exact.top_source(lt.index, None, q, "contribution")
    assert j == int(np.argmax(lt.contribution_inter.sum(0)[q]))
    j = exact.top_source(lt.index, 1, q, "attention")
    assert j == int(np.argmax(lt.attention[1, q]))


def test_topk_rows(tiny_llama, ids, exact):
    k = 3
    top = E.build(tiny_llama, ids, top_k=k, exact_max_tokens=5)
    assert top.top_k == k and not top.exact
    T, H = top.T, top.num_heads
    for li, l in enumerate(top.layers):
        for v in (0, H - 1, None):
            for q in (0, 1, 6, T - 1):
                full = exact.sources(l, v, q, "attention")
                got = top.sources(l, v, q, "attention")
                assert len(got) == min(k, q + 1)
                assert {p for p, _ in got} == {p for p, _ in full[:len(got)]}
                for p, x in got:   # values rounded to 7 significant bits (< 0.8%)
                    assert x == pytest.approx(dict(full)[p], rel=8e-3, abs=1e-3)
                full_c = sorted(exact.sources(l, v, q, "contribution"), key=lambda p: (-abs(p[1]), p[0]))[:k]
                got_c = top.sources(l, v, q, "contribution")
                assert sorted(p for p, _ in got_c) == sorted(p for p, _ in full_c)
                for p, x in got_c:
                    assert x == pytest.approx(dict(full_c)[p], rel=8e-3, abs=1e-3)


def test_head_stats_and_sinks(exact, tiny_llama, ids):
    from attngeom.streaming.reducers import HeadStats
    from attngeom.streaming import stream

    hs = stream(tiny_llama, [ids], [HeadStats()], progress=False)[0].result()
    H = exact.num_heads
    for k, l in enumerate(exact.layers):
        g = hs[hs.layer == l].sort_values("head")
        np.testing.assert_allclose(exact.head_stats["sink_rate"][k], g.sink_rate, rtol=1e-6)
        np.testing.assert_allclose(exact.head_stats["head_share"][k], g.head_share, rtol=1e-6)
        assert exact.layer_sink["sink_attention"][k] == pytest.approx(g.sink_rate.mean())
        assert exact.layer_sink["sink_share"][k] == pytest.approx(g.sink_contribution_inter.sum())
    assert set(np.unique(exact.head_stats["regime"])) <= {0, 1, 2}
    assert exact.head_stats["regime"].shape == (len(exact.layers), H)


def test_layers_subset_and_bad_layers(tiny_llama, ids):
    d = E.build(tiny_llama, ids, layers=[1])
    assert d.layers == [1] and len(d.rows["attention"]) == 1
    with pytest.raises(Exception, match="layer 9 does not exist"):
        E.build(tiny_llama, ids, layers=[9])
    with pytest.raises(Exception, match="not analysed"):
        d.sources(0, None, 1, "attention")


def test_one_token_is_refused(tiny_llama):
    with pytest.raises(Exception, match="at least 2"):
        E.build(tiny_llama, [tiny_llama.tokenizer.bos_token_id])


def test_from_trace_equals_build(exact, trace):
    d = E.from_trace(trace)
    assert d.residual_share is None
    for m in E.METRICS:
        for a, b in zip(d.rows[m], exact.rows[m]):
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), atol=2e-3)


# ------------------------------------------------------------------------------------------------
# A third measure of the registry (--measure): its rows are the trace's maps and scores
# ------------------------------------------------------------------------------------------------

PREPARED = ["grad_attention", "rollout"]


@pytest.fixture(scope="module")
def prepared_trace(tiny_llama, ids):
    return analyze(tiny_llama, ids, prepare=PREPARED)


def assert_rows_equal_trace(data, trace, name):
    """Stored rows of ``name`` = ``LayerTrace.metric(name)`` per head and ``token_score(name)`` for the
    layer, within float16 rounding; nothing above the diagonal; one view for a layer-only measure."""
    H, T = data.num_heads, data.T
    layer_only = registry.get(name).layer_only
    for k, lt in enumerate(trace.layers):
        x = data.rows[name][k].astype(np.float32)
        assert x.shape == ((1 if layer_only else H + 1), T, T)
        assert not np.triu(x, 1).any()
        np.testing.assert_allclose(x[-1], np.tril(lt.token_score(name)), rtol=2e-3, atol=1e-5)
        if not layer_only:
            np.testing.assert_allclose(x[:H], np.tril(lt.metric(name)), rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize("name", ["value_zeroing", "alti", "grad_attention", "rollout"])
def test_measure_rows_equal_the_trace(tiny_llama, ids, prepared_trace, name):
    """A per-head measure, a layer-only one and two computed before the forward (build computes
    their pass itself; from_trace reads a trace analysed with prepare=[...])."""
    built = E.build(tiny_llama, ids, measure=name)
    assert built.measure == name and set(built.rows) == set(E.METRICS) | {name}
    assert_rows_equal_trace(built, prepared_trace, name)
    assert_rows_equal_trace(E.from_trace(prepared_trace, measure=name), prepared_trace, name)
    lt, q = prepared_trace.layers.values()[-1], built.T - 2      # the last row of a gradient is 0: it predicts nothing scored
    assert built.top_source(lt.index, None, q, name) == int(np.argmax(lt.token_score(name)[q]))


def test_measure_leaves_the_other_rows_as_they_were(tiny_llama, ids, exact):
    d = E.build(tiny_llama, ids, measure="value_zeroing")
    for m in E.METRICS:
        for a, b in zip(d.rows[m], exact.rows[m]):
            np.testing.assert_array_equal(a, b)


def test_measure_topk_rows(tiny_llama, ids):
    """Top-k rows of a measure are the top of its exact rows by |value| (gradient × attention is
    signed); a layer-only measure keeps the layer's view only."""
    k = 3
    for name in ("grad_attention", "alti"):
        full = E.build(tiny_llama, ids, measure=name)
        top = E.build(tiny_llama, ids, measure=name, top_k=k, exact_max_tokens=5)
        assert top.rows[name][0][0].shape[0] == (1 if registry.get(name).layer_only else top.num_heads + 1)
        heads = (None,) if registry.get(name).layer_only else (0, None)
        for l in top.layers:
            for v in heads:
                for q in (0, 6, top.T - 2):
                    exact = dict(full.sources(l, v, q, name))
                    want = sorted((abs(x) for x in exact.values()), reverse=True)[:k]
                    got = top.sources(l, v, q, name)       # ties at the k-th value: either source
                    assert sorted((abs(x) for _, x in got), reverse=True) == pytest.approx(want, rel=8e-3, abs=1e-6)
                    for p, x in got:
                        assert x == pytest.approx(exact[p], rel=8e-3, abs=1e-6)


def test_layer_only_measure_has_no_per_head_view(tiny_llama, ids):
    d = E.build(tiny_llama, ids, measure="alti")
    with pytest.raises(Exception, match="alti is defined on the layer .* no per-head form"):
        d.sources(d.layers[0], 0, 3, "alti")
    p = R.payload(d)
    assert p["measure"] == {"name": "alti", "label": "ALTI", "formula": registry.get("alti").formula,
                            "layer_only": True}
    raw, blocks = R.pack(d)
    words = np.frombuffer(raw[: len(raw) // 2], np.uint8).astype(np.uint16) | (
        np.frombuffer(raw[len(raw) // 2:], np.uint8).astype(np.uint16) << 8)
    T, q, k = d.T, d.T - 1, len(d.layers) - 1
    start = blocks["alti"][k]["val"] + q * (q + 1) // 2      # view 0 = the layer: no per-head views stored
    assert blocks["alti"][k]["val"] + T * (T + 1) // 2 == words.size         # the last part: one view
    np.testing.assert_array_equal(words[start:start + q + 1].view(np.float16), d.rows["alti"][k][0, q, :q + 1])
    assert "measure" not in R.payload(E.build(tiny_llama, ids, layers=[0]))     # pages without one: as before


def test_measure_refusals(tiny_llama, ids, trace, prepared_trace, tmp_path):
    from attngeom.generation.decoding import Decoding
    from attngeom.traces.trace import Trace

    with pytest.raises(Exception, match="unknown measure 'nope'"):
        E.build(tiny_llama, ids, measure="nope")
    with pytest.raises(Exception, match="not for a generation"):
        E.build(tiny_llama, "The cat", decoding=Decoding(2), measure="rollout")
    # a trace analysed without prepare=[...], and a saved one (prepared maps are not saved)
    for t in (trace, Trace.load(prepared_trace.save(tmp_path / "saved"))):
        for name in PREPARED:
            with pytest.raises(Exception, match=rf"analyze\(model, text, prepare=\['{name}'\]\)"):
                E.from_trace(t, measure=name)
    with pytest.raises(Exception, match="prepare=\\['rollout'\\]"):
        trace.to_html(tmp_path / "t.html", measure="rollout")
    assert trace.to_html(tmp_path / "vz.html", measure="value_zeroing").is_file()   # needs no pass


# ------------------------------------------------------------------------------------------------
# HTML: self-contained, data never markup
# ------------------------------------------------------------------------------------------------

NASTY = ["<s>", "<script>alert(1)</script>", "</script><!--", "\"quoted\" 'single'", "back\\slash\\",
         "a|b||c", "cr\rlf\n", "שלום", "مرحبا", "😀👍🏽", "&amp; &lt;", "\u2028\u2029", "]]>", "{{x}}"]


def nasty_data(tiny_llama):
    ids = tiny_llama.encode("x" * (len(NASTY) + 2))[: len(NASTY)]
    d = E.build(tiny_llama, ids)
    d.tokens = list(NASTY)
    return d


def _data_block(page: str) -> str:
    m = re.search(r'<script id="explore-data" type="application/json">(.*?)</script>', page, re.S)
    assert m
    return m.group(1)


def test_page_is_self_contained_and_escaped(tiny_llama):
    d = nasty_data(tiny_llama)
    page = R.render(d)
    block = _data_block(page)
    for ch in "<>&\u2028\u2029":
        assert ch not in block
    parsed = json.loads(block)
    assert parsed["tokens"] == NASTY
    assert page.count("<script") == 2 and page.count("</script>") == 2
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', page)   # no network
    d.tokens[3] = "half \ud83d surrogate"
    assert json.loads(_data_block(R.render(d)))["tokens"][3] == "half \ud83d surrogate"
    assert "textContent" in page and "innerHTML" not in page and "insertAdjacentHTML" not in page
    assert "default-src 'none'" in page


def test_round_float16():
    x = np.array([0.1234, -0.5678, 1e-5, 0.0, 1.0, 3.14159], dtype=np.float32)
    r = E.round_float16(x, 6).astype(np.float32)
    np.testing.assert_allclose(r, x, rtol=2 ** -7, atol=1e-6)  # atol: float16 subnormals
    assert (E.round_float16(x, 6).view(np.uint16) & 0xF).max() == 0
    np.testing.assert_array_equal(E.round_float16(x, 10), x.astype(np.float16))


def test_source_codes():
    P = E.PAD
    idx = np.array([[[0, P, P], [1, 0, P], [2, 1, 0], [3, 1, P]]], dtype=np.uint16)
    codes = R.encode_sources(idx).reshape(1, 4, 3)
    # row i: first code i - j, then gaps; position 0 -> ZERO; PAD stays
    assert codes[0, 0].tolist() == [R.ZERO, P, P]
    assert codes[0, 2].tolist() == [0, 1, R.ZERO]
    assert codes[0, 3].tolist() == [0, 2, P]


def test_payload_roundtrip(exact):
    p = R.payload(exact)
    assert p["T"] == exact.T and p["exact"] and p["k"] is None
    raw, blocks = R.pack(exact)
    assert zlib.decompress(base64.b64decode(p["bin"])) == raw
    words = np.frombuffer(raw[: len(raw) // 2], np.uint8).astype(np.uint16) | (
        np.frombuffer(raw[len(raw) // 2:], np.uint8).astype(np.uint16) << 8)
    T, H = exact.T, exact.num_heads
    k = len(exact.layers) - 1
    start = blocks["contribution"][k]["val"] + H * T * (T + 1) // 2     # view H, row 0
    q = T - 1
    row = words[start + q * (q + 1) // 2: start + q * (q + 1) // 2 + q + 1].view(np.float16)
    np.testing.assert_array_equal(row, exact.rows["contribution"][k][H, q, : q + 1])


def test_trace_to_html_and_repr(trace, tmp_path):
    path = trace.to_html(tmp_path / "t.html")
    assert path.is_file() and path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    shown = trace._repr_html_()                    # the notebook display: a few kB, no maps, no script
    assert len(shown) < 20_000 and "<script" not in shown and "to_html" in shown
    frame = trace.explore()._repr_html_()          # the explorer inline, on request
    assert frame.startswith("<iframe srcdoc=") and "<script" not in frame   # escaped inside srcdoc


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--text", "   "], "--text is empty"),
    (["--file", "/nonexistent/file.txt"], "input file not found"),
    (["--layers", "x"], "--layers"),
    (["--layers", "-1"], "does not exist"),
    (["--top-k", "0"], "--top-k must be at least 1"),
    (["--exact-max-tokens", "-3"], "--exact-max-tokens"),
    (["--measure", "nope"], "unknown measure 'nope'; known: attention,"),
    (["--measure", "grad_attention", "--generate", "3"], "not for a generation"),
])
def test_bad_input_before_the_model(no_model, argv, message, tmp_path, capsys):
    rc = main(["explore", *argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()


def test_empty_file(no_model, tmp_path, capsys):
    f = tmp_path / "empty.txt"
    f.write_text("\n \n")
    assert main(["explore", "--file", str(f), "--out", str(tmp_path / "o")]) == 2
    assert "is empty" in capsys.readouterr().err


def test_command_end_to_end(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "x"
    rc = main(["explore", "--model", str(tiny_llama_dir), "--text", TEXT, "--layers", "0,1", "--out", str(out)])
    assert rc == 0
    page = (out / "explore.html").read_text(encoding="utf-8")
    data = json.loads(_data_block(page))
    assert data["layers"] == [0, 1] and data["exact"]
    manifest = json.loads((out / "run.json").read_text())
    assert "explore.html" in manifest["files"]
    capsys.readouterr()
    # a layer beyond the model: refused after loading, one line, exit 2
    assert main(["explore", "--model", str(tiny_llama_dir), "--text", TEXT, "--layers", "7",
                 "--out", str(tmp_path / "y")]) == 2
    assert "layer 7 does not exist" in capsys.readouterr().err
    # another run's directory is refused without --overwrite
    assert main(["explore", "--model", str(tiny_llama_dir), "--text", TEXT + " more", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["explore", "--model", str(tiny_llama_dir), "--text", TEXT + " more", "--out", str(out),
                 "--overwrite"]) == 0


def test_command_measure(tiny_llama_dir, tmp_path, capsys):
    """--measure puts the measure on the page and into the run's identity (recorded only when set: a
    default run's identity is as before), so a rerun with another measure is another run."""
    out = tmp_path / "m"
    base = ["explore", "--model", str(tiny_llama_dir), "--text", TEXT, "--layers", "0,1"]
    assert main([*base, "--measure", "rollout", "--out", str(out)]) == 0
    data = json.loads(_data_block((out / "explore.html").read_text(encoding="utf-8")))
    assert data["measure"]["name"] == "rollout" and data["measure"]["layer_only"]
    assert set(data["blocks"]) == {*E.METRICS, "rollout"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["measure"] == "rollout" and summary["settings"]["measure"] == "rollout"
    assert "attention rollout" in (out / "report.md").read_text(encoding="utf-8")
    capsys.readouterr()
    assert main([*base, "--measure", "alti", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "plain")]) == 0
    assert "measure" not in json.loads((tmp_path / "plain" / "summary.json").read_text())["settings"]


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma2", "gemma3_text", "phi3"])
def test_every_architecture(arch):
    """Rows, residual shares (Gemma 2/3: after the post-attention norm) and the flow on other
    architectures (sliding windows, soft-capping, biases, fused qkv)."""
    from tiny_models import tiny_model as tm

    h = tm(arch)
    d = E.build(h, h.encode(TEXT))
    assert d.residual_share is not None and np.isfinite(d.residual_share).all()
    f = E.flow([d.transfer_rows(l) for l in d.layers], d.T - 1, d.T)
    np.testing.assert_allclose(f.sum(1), 1.0, atol=5e-3)
    assert json.loads(_data_block(R.render(d)))["T"] == d.T
