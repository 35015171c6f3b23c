"""Direct and total effects of heads (attngeom.generation.effects) and activation patching between two
runs (attngeom.traces.compare.patch_heads), each against an independent computation by hand: hooks on
the model's own modules, no attngeom capture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attngeom.errors import InputError
from attngeom.generation.effects import Answer, direct_effects, head_inputs, patched_logits
from attngeom.traces.effects import head_effects
from attngeom.streaming.passes import to_ids
from attngeom.traces.compare import compare_texts, patch_heads
from tiny_models import tiny_model

TEXT = "The cat sat on"
TARGET, CONTRAST = "m", "d"


def _hooked(handle, ids, hooks):
    """Logits ``[T, V]`` of a plain forward of ``ids`` with ``hooks`` ``(module, pre_hook)`` registered."""
    hs = [m.register_forward_pre_hook(fn) for m, fn in hooks]
    try:
        with torch.no_grad():
            return handle.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
    finally:
        for h in hs:
            h.remove()


def _rms(x, w, eps, plus_one):
    g = (1 + w) if plus_one else w
    return g.double() / torch.sqrt(x.double().pow(2).mean() + eps)


@pytest.mark.parametrize("arch", ["llama", "gemma", "gemma3_text"])
def test_direct_effects_sum_to_the_logit_less_what_no_head_wrote(arch):
    """Σ_h direct effects = logit difference − U·(k_f ⊙ (x − Σ_l A_l)): ``x`` the final norm's input,
    ``A_l`` what layer l's attention adds to the residual (the attention module's output, or Gemma 3's
    post-attention norm of it), ``k_f`` the final norm's frozen scale from its weight. Llama: GQA; Gemma:
    (1 + w) norms; Gemma 3: a norm between the heads and the residual."""
    handle = tiny_model(arch)
    model, ids = handle.model, to_ids(handle, TEXT)
    layers = model.model.layers
    seen = {}

    def keep(key):
        def hook(m, args, out):
            seen[key] = (out[0] if isinstance(out, tuple) else out)[0, -1].double()
        return hook

    def keep_in(m, args, out):
        seen["x"] = args[0][0, -1].double()

    added = [(lay.post_attention_layernorm if arch == "gemma3_text" else lay.self_attn) for lay in layers]
    hs = [m.register_forward_hook(keep(l)) for l, m in enumerate(added)] + [model.model.norm.register_forward_hook(keep_in)]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    finally:
        for h in hs:
            h.remove()
    norm = model.model.norm
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    k = _rms(seen["x"], norm.weight.detach(), eps, plus_one=arch != "llama")
    U = model.lm_head.weight.detach().double()
    u = U[handle.tokenizer.convert_tokens_to_ids(TARGET)] - U[handle.tokenizer.convert_tokens_to_ids(CONTRAST)]
    attention = sum(seen[l] for l in range(len(layers)))
    not_heads = float((k * (seen["x"] - attention)) @ u)
    full = float((k * seen["x"]) @ u)
    eff, parts = direct_effects(handle, ids, Answer(handle, TARGET, CONTRAST))
    assert eff.shape == (handle.num_layers, handle.num_heads)
    assert full == pytest.approx(float(logits[handle.tokenizer.convert_tokens_to_ids(TARGET)]
                                       - logits[handle.tokenizer.convert_tokens_to_ids(CONTRAST)]), abs=1e-4)
    assert parts["logit"] == pytest.approx(full, abs=1e-4)
    assert eff.sum() == pytest.approx(full - not_heads, abs=1e-4)
    assert abs(eff).max() > 1e-3                                            # not all zero


def test_one_heads_direct_effect_is_its_slice_through_o_proj(tiny_llama):
    """Head h's direct effect = U·(k_f ⊙ o_proj(only head h's slice kept)) (no o_proj bias in Llama)."""
    handle, ids = tiny_llama, to_ids(tiny_llama, TEXT)
    model, d = handle.model, handle.head_dim
    seen = {}
    hs = [model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("o", a[0][0, -1])),
          model.model.norm.register_forward_hook(lambda m, a, o: seen.__setitem__("x", a[0][0, -1]))]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hs:
            h.remove()
    k = _rms(seen["x"], model.model.norm.weight.detach(), model.model.norm.variance_epsilon, plus_one=False)
    u = model.lm_head.weight.detach().double()[handle.tokenizer.convert_tokens_to_ids(TARGET)]
    eff, _ = direct_effects(handle, ids, Answer(handle, TARGET))
    for h in range(handle.num_heads):
        only = torch.zeros_like(seen["o"])
        only[h * d:(h + 1) * d] = seen["o"][h * d:(h + 1) * d]
        with torch.no_grad():
            out = model.model.layers[1].self_attn.o_proj(only).double()
        assert eff[1, h] == pytest.approx(float((k * out) @ u), abs=1e-5)


def _zero_slice(h, d):
    def hook(m, args):
        x = args[0].clone()
        x[..., h * d:(h + 1) * d] = 0
        return (x,)
    return hook


def _running_mean_slice(h, d):
    def hook(m, args):
        x = args[0].clone()
        s = x[..., h * d:(h + 1) * d]
        x[..., h * d:(h + 1) * d] = s.cumsum(1) / torch.arange(1, s.shape[1] + 1, dtype=s.dtype)[:, None]
        return (x,)
    return hook


@pytest.mark.parametrize("arch", ["llama", "gemma", "gemma3_text"])
def test_ablation_is_the_o_proj_slice_zeroed_by_hand(arch):
    """Zero ablation through the capture's head removal = a forward with the head's o_proj input slice
    zeroed by a pre-hook; mean ablation = that slice replaced by its running mean over the positions up
    to each one (the head's outputs before any other change: only this head is ablated)."""
    handle = tiny_model(arch)
    ids, d = to_ids(handle, TEXT), handle.head_dim
    clean = _hooked(handle, ids, [])[-1]
    for ablation, edit in (("zero", _zero_slice), ("mean", _running_mean_slice)):
        for metric, contrast in (("log_prob", None), ("logit_diff", CONTRAST)):
            ans = Answer(handle, TARGET, contrast)
            df = head_effects(handle, TEXT, TARGET, contrast=contrast, ablation=ablation).set_index(["layer", "head"])
            assert df.attrs["metric"] == metric and df.attrs["clean"] == pytest.approx(float(ans.score(clean)), abs=1e-5)
            for l, h in [(0, 0), (handle.num_layers - 1, handle.num_heads - 1), (1, 2)]:
                o_proj = handle.model.model.layers[l].self_attn.o_proj
                by_hand = _hooked(handle, ids, [(o_proj, edit(h, d))])[-1]
                want = float(ans.score(clean)) - float(ans.score(by_hand))
                assert df.loc[(l, h), "total_effect"] == pytest.approx(want, abs=2e-4), (ablation, metric, l, h)
    assert df["total_effect"].abs().max() > 1e-3


def test_head_effects_table_ranks_by_effect_with_the_share_beside_it(tiny_llama):
    df = head_effects(tiny_llama, TEXT, TARGET, contrast=CONTRAST, rank="direct", top=5)
    assert len(df) == 5 and list(df["rank"]) == list(range(5))
    assert (np.diff(df["direct_effect"].abs().to_numpy()) <= 1e-12).all()
    full = head_effects(tiny_llama, TEXT, TARGET, contrast=CONTRAST)
    trace_shares = {}
    from attngeom.traces.trace import analyze

    tr = analyze(tiny_llama, TEXT)
    for lt in tr.layers:
        trace_shares.update({(lt.index, h): float(lt.head_share[h, -1]) for h in range(lt.num_heads)})
    for r in full.itertuples():
        assert r.share == pytest.approx(trace_shares[(r.layer, r.head)], abs=1e-5)
    assert (np.diff(full["total_effect"].abs().to_numpy()) <= 1e-12).all()
    assert sorted(full["rank_by_share"]) == list(range(len(full)))
    assert full.attrs["p_target"] > 0 and full.attrs["logit_diff"] == pytest.approx(full.attrs["clean"])


@pytest.mark.parametrize("bad, match", [(dict(target="mm"), "2 tokens"), (dict(target=10 ** 6), "not a token"),
                                        (dict(contrast="m"), "contrast is the target"),
                                        (dict(ablation="resample"), "ablation must be"), (dict(rank="x"), "rank must be"),
                                        (dict(layers=[9]), "layer")])
def test_head_effects_refuses_bad_input_in_one_line(tiny_llama, bad, match):
    kw = {"target": TARGET, **bad}
    with pytest.raises(InputError, match=match) as e:
        head_effects(tiny_llama, TEXT, kw.pop("target"), **kw)
    assert "\n" not in str(e.value)


A, B = "The cat sat on the mat", "The dog sat on the mat"


def test_patching_every_head_everywhere_gives_bs_logits_and_none_changes_nothing(tiny_llama):
    """All heads' outputs from b into a at every position: a's logits become b's wherever the tokens are
    the same (the residual there differs only through attention); patching no head: a's own logits."""
    handle = tiny_llama
    ia, ib = to_ids(handle, A), to_ids(handle, B)
    src_b, logits_b = head_inputs(handle, ib)
    _, logits_a = head_inputs(handle, ia)
    every = [(l, h) for l in range(handle.num_layers) for h in range(handle.num_heads)]
    got = patched_logits(handle, ia, src_b, [every, []], range(len(ia)))
    same = [i for i in range(len(ia)) if ia[i] == ib[i] and i > max(j for j in range(len(ia)) if ia[j] != ib[j])]
    assert torch.allclose(got[0, same], logits_b[same], atol=1e-4)
    assert not torch.allclose(got[0, same], logits_a[same], atol=1e-3)
    assert torch.allclose(got[1], logits_a, atol=1e-5)


def test_patch_heads_table_against_a_patch_by_hand(tiny_llama):
    handle = tiny_llama
    df = patch_heads(handle, A, B, "m", contrast="d")
    ans = Answer(handle, "m", "d")
    ia, ib = to_ids(handle, A), to_ids(handle, B)
    src_b, logits_b = head_inputs(handle, ib)
    assert df.attrs["m_b"] == pytest.approx(float(ans.score(logits_b[-1])), abs=1e-6)
    changed = [i for i in range(len(ia)) if ia[i] != ib[i]]
    assert set(df["at"]) == {"changed", "prediction"} and df.attrs["changed"] == changed == [5, 6, 7]
    d = handle.head_dim
    for where, pos in (("changed", changed), ("prediction", [len(ia) - 1])):
        row = df[(df["at"] == where) & (df["layer"] == 2) & (df["head"] == 1)].iloc[0]

        def hook(m, args, pos=pos):
            x = args[0].clone()
            x[0, pos, d:2 * d] = src_b[2][pos, d:2 * d]
            return (x,)

        by_hand = _hooked(handle, ia, [(handle.model.model.layers[2].self_attn.o_proj, hook)])[-1]
        assert row["patched"] == pytest.approx(float(ans.score(by_hand)), abs=1e-5)
        assert row["effect"] == pytest.approx(row["patched"] - df.attrs["m_a"], abs=1e-9)
    with pytest.raises(InputError, match="same number of tokens"):
        patch_heads(handle, A, "The horse sat on the mat", "m")


def test_compare_texts_reports_the_prediction_and_the_patching(tiny_llama):
    a, b, d = compare_texts(tiny_llama, A, text_b=B, answer="m", contrast="d")
    p = d.prediction.set_index(["side", "role"])
    ans = Answer(tiny_llama, "m", "d")
    for side, text in (("a", A), ("b", B)):
        logits = head_inputs(tiny_llama, to_ids(tiny_llama, text))[1][-1]
        assert p.loc[(side, "answer"), "p"] == pytest.approx(float(torch.softmax(logits.double(), -1)[ans.target]))
        assert p.loc[(side, "contrast"), "m"] == pytest.approx(float(ans.score(logits)), abs=1e-6)
    assert d.patching is not None and len(d.patching) == 2 * tiny_llama.num_layers * tiny_llama.num_heads
    with pytest.raises(InputError, match="contrast token needs"):
        compare_texts(tiny_llama, A, text_b=B, contrast="d")


def test_compare_command_writes_the_prediction_and_opens_at_the_most_changed_layer(tiny_llama_dir, tmp_path, capsys):
    import json

    import pandas as pd

    from attngeom.cli import main

    out = tmp_path / "c"
    assert main(["compare", "--model", str(tiny_llama_dir), "--text", A, "--text-b", B, "--answer", "m",
                 "--contrast", "d", "--out", str(out)]) == 0
    pred, patch = pd.read_parquet(out / "prediction.parquet"), pd.read_parquet(out / "patching.parquet")
    assert set(pred["side"]) == {"a", "b"} and set(patch["at"]) == {"changed", "prediction"}
    worst = json.loads((out / "summary.json").read_text())["most_different_layer"]["contribution"]["layer"]
    page = (out / "compare.html").read_text()
    assert page.count(f"&quot;initial_layer&quot;:{worst}") == 2 and 'id="prediction"' in page
    assert "Activation patching" in (out / "report.md").read_text()
    bad = tmp_path / "bad"
    assert main(["compare", "--model", str(tiny_llama_dir), "--text", A, "--text-b", B, "--contrast", "d",
                 "--out", str(bad)]) == 2
    assert "--contrast needs --answer" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not bad.exists() or not (bad / "summary.json").exists()


def test_explorer_heads_panel_holds_the_direct_effects(tiny_llama):
    """``build`` adds the heads panel's ``direct_effect`` grid: each head's direct effect on the logit of
    the model's top prediction after the text (equal to direct_effects), and the page offers it."""
    from attngeom.explorer import data as E
    from attngeom.reports.explore import render

    ids = to_ids(tiny_llama, TEXT)
    d = E.build(tiny_llama, ids, layers=[0, 2])
    top = int(head_inputs(tiny_llama, ids)[1][-1].argmax())
    want, _ = direct_effects(tiny_llama, ids, Answer(tiny_llama, top))
    np.testing.assert_allclose(d.head_stats["direct_effect"], want[[0, 2]], atol=1e-9)
    assert '"direct_effect":[[' in render(d)
    from attngeom.traces.trace import analyze

    assert "direct_effect" not in E.from_trace(analyze(tiny_llama, ids)).head_stats       # no model: no grid


def test_answer_heads_table_holds_each_heads_direct_effect(tiny_llama_dir, tiny_llama, tmp_path):
    """``attngeom analyze --generate``'s answer_heads.parquet: each row's ``direct_effect`` is the head's
    direct effect on that generated token's logit at its producing row (the whole answer: the mean)."""
    import pandas as pd

    from attngeom.cli import main

    out = tmp_path / "g"
    assert main(["analyze", "--model", str(tiny_llama_dir), "--text", TEXT, "--generate", "3", "--out", str(out)]) == 0
    heads = pd.read_parquet(out / "answer_heads.parquet")
    steps = sorted(int(s) for s in heads["step"].dropna().unique())
    assert steps and "direct_effect" in heads
    per_step = []
    for s in steps:
        row = heads[(heads["step"] == s) & (heads["by"] == "contribution")].iloc[0]
        per_step.append((s, row, int(row["token_id"])))
    # the producing row of step s is position P - 1 + s: rebuild the prefix from the table's token ids
    answer = [t for _, _, t in per_step]
    for s, row, token in per_step:
        want, _ = direct_effects(tiny_llama, to_ids(tiny_llama, TEXT) + answer[:s], Answer(tiny_llama, token))
        assert row["direct_effect"] == pytest.approx(want[int(row["layer"]), int(row["head"])], abs=1e-4)
    whole = heads[heads["step"].isna() & (heads["by"] == "contribution")].iloc[0]
    want = np.mean([direct_effects(tiny_llama, to_ids(tiny_llama, TEXT) + answer[:s], Answer(tiny_llama, t))[0]
                    [int(whole["layer"]), int(whole["head"])] for s, _, t in per_step])
    assert whole["direct_effect"] == pytest.approx(want, abs=1e-4)
    assert "direct effect" in (out / "report.md").read_text()


def test_compare_summary_holds_the_prediction_and_the_top_patched_heads(tiny_llama):
    import json

    _, _, d = compare_texts(tiny_llama, A, text_b=B, answer="m", contrast="d")
    s = json.loads(json.dumps(d.summary()))
    assert {(r["side"], r["role"]) for r in s["prediction"]} == {("a", "answer"), ("a", "contrast"), ("b", "answer"),
                                                                  ("b", "contrast")}
    assert s["patching"]["m_a"] == pytest.approx(d.patching.attrs["m_a"]) and len(s["patching"]["top"]) == 10
    best = d.patching[(d.patching["at"] == "prediction")].iloc[0]
    assert any(r["layer"] == best["layer"] and r["head"] == best["head"] and r["at"] == "prediction"
               for r in s["patching"]["top"])
