"""Heads behind a token (attngeom.generation.heads, Trace.heads_for) against a hand computation from
the raw captured maps; special and chat-template tokens marked; what the API takes as a model."""

import inspect

import numpy as np
import pandas as pd
import pytest
import torch

import attngeom
from attngeom.errors import InputError
from attngeom.generation.decoding import Decoding, stream_generation
from attngeom.generation.prompts import FALLBACK_CHAT_TEMPLATE, chat_template_of, prompt_ids, template_positions
from attngeom.generation.heads import AnswerHeads
from attngeom.traces.trace import Trace, analyze
from tiny_models import tiny_chat_tokenizer, tiny_model

PROMPT = "capital of France?"
N = 4


@pytest.fixture(scope="module")
def chat_handle():
    handle = tiny_model("llama")
    handle.tokenizer = tiny_chat_tokenizer()
    return handle


@pytest.fixture(scope="module")
def trace(chat_handle):
    return analyze(chat_handle, PROMPT, generate=N, chat=True, stop=())


def hand_shares(lt, row: int) -> tuple[np.ndarray, np.ndarray]:
    """C_ij^h and a_ij^h / H of one row, in numpy from a, v and W_O (model-space vectors formed)."""
    a = lt.a.double().numpy()                                   # [H, T, T]
    v = lt.v.double().numpy()                                   # [H, T, d]
    w_o = lt.w_o.double().numpy()                               # [D, H*d]
    H, T, d = v.shape
    vt = np.stack([v[h] @ w_o[:, h * d:(h + 1) * d].T for h in range(H)])     # ṽ_j^h [H, T, D]
    o = sum(a[h, row] @ vt[h] for h in range(H))                                # o_i [D]
    C = np.stack([a[h, row, :, None] * vt[h] @ o for h in range(H)]) / (o @ o)  # [H, T]
    return C[:, :row + 1], a[:, row, :row + 1] / H


def test_heads_table_equals_the_hand_computation(trace):
    target = len(trace) - 1
    row = target - 1                                            # the producing row
    for by in ("contribution", "attention"):
        df = trace.heads_for(target, by=by, top=None, exclude_special=False)
        assert len(df) == len(trace.layers) * trace.layers[0].num_heads * (row + 1)
        for lt in trace.layers:
            want = hand_shares(lt, row)[0 if by == "contribution" else 1]
            got = np.zeros_like(want)
            sel = df[df["layer"] == lt.index]
            got[sel["head"], sel["source"]] = sel["share"]
            assert np.allclose(got, want, atol=1e-5), (by, lt.index)
            assert abs(sel["share"].sum() - 1) < 1e-4           # each layer's shares sum to 1
            # ranked within the layer, largest first
            assert (sel.sort_values("rank_in_layer")["share"].diff().dropna() <= 0).all()
        assert (df["share"].diff().dropna() <= 0).all()          # listed by share across layers


def test_top_source_and_exclusion(trace):
    full = trace.heads_for(-1, top=None, exclude_special=False)
    kept = trace.heads_for(-1, top=None)
    marked = full["is_special"] | full["is_template"]
    assert marked.any() and not (kept["is_special"] | kept["is_template"]).any()
    assert len(kept) == (~marked).sum()
    assert np.allclose(np.sort(kept["share"]), np.sort(full.loc[~marked, "share"]))   # shares unchanged
    assert trace.heads_for(-1, top=3).equals(kept.head(3))
    one = trace.heads_for(-1, source=20, top=None)
    assert set(one["source"]) == {20} and len(one) == len(trace.layers) * trace.layers[0].num_heads
    # the earlier answer tokens and the query itself are sources too
    assert {"prompt", "answer"} <= set(full["part"]) and full["source"].max() == len(trace) - 2


def test_whole_answer_is_the_mean_of_its_tokens(trace):
    P, T = trace.prompt_length, len(trace)
    whole = trace.heads_for("answer", top=None, exclude_special=False)
    parts = [trace.heads_for(t, top=None, exclude_special=False) for t in range(P, T)]
    key = ["layer", "head", "source"]
    acc = pd.concat(parts).groupby(key)["share"].sum() / len(parts)
    got = whole.set_index(key)["share"]
    assert np.allclose(got.reindex(acc.index).fillna(0).to_numpy(), acc.to_numpy(), atol=1e-9)
    assert np.allclose(whole.groupby("layer")["share"].sum(), 1, atol=1e-4)
    assert trace.heads_for([P, P + 1], top=None).shape[0] > 0


def test_own_row_and_bad_targets(trace):
    own = trace.heads_for(5, predicted=False, top=None, exclude_special=False)
    assert own["source"].max() == 5
    for bad, match in [(0, "predicted by no row"), (len(trace), "outside"), ("everything", "'answer'"),
                       ([], "no target")]:
        with pytest.raises(InputError, match=match):
            trace.heads_for(bad)
    with pytest.raises(InputError, match="by must be"):
        trace.heads_for(-1, by="value")
    with pytest.raises(InputError, match="not in the trace"):
        trace.heads_for(-1, layers=[7])
    plain = analyze(tiny_model("qwen2"), "a b c d")
    with pytest.raises(InputError, match="generation"):
        plain.heads_for("answer")
    assert set(plain.heads_for(-1, exclude_special=False, top=None)["part"]) == {"text"}


def test_template_and_special_tokens_are_marked(chat_handle, trace):
    ids = prompt_ids(chat_handle, PROMPT, chat=True)
    text = chat_handle.tokenizer.decode(ids)               # "<s>user: capital of France?</s>\n<s>assistant:"
    assert text == f"<s>user: {PROMPT}</s>\n<s>assistant:"
    start = len("<s>user: ") - len("<s>") + 1               # one token per character; <s> is one token
    user = set(range(start, start + len(PROMPT)))
    assert set(template_positions(chat_handle, PROMPT, chat=True)) == set(range(len(ids))) - user
    assert set(trace.template) == set(range(len(ids))) - user
    assert set(trace.special) == {p for p, i in enumerate(trace.ids) if i in (0, 1, 2, 3)}
    marks = trace.marks()
    assert marks["is_special"].tolist() == [i in (0, 1, 2, 3) for i in trace.ids]
    assert template_positions(chat_handle, PROMPT) == ()   # a plain prompt: no template


def test_marks_survive_save_and_load(trace, tmp_path):
    back = Trace.load(trace.save(tmp_path / "t"))
    assert (back.special, back.template) == (trace.special, trace.template)
    pd.testing.assert_frame_equal(back.heads_for("answer"), trace.heads_for("answer"), atol=1e-6)


def test_answer_heads_reducer_equals_the_trace(chat_handle, trace):
    P = trace.prompt_length
    special = {trace.ids[p] for p in trace.special}
    reducer = AnswerHeads(special, trace.template, top=6)
    stream_generation(chat_handle, trace.ids[:P], [reducer], Decoding(N, stop=()))
    res = reducer.result()
    assert set(res["by"]) == {"contribution", "attention"} and res["step"].isna().sum() == 12
    for by in ("contribution", "attention"):
        for step in [*range(N), None]:
            sel = res[(res["by"] == by) & (res["step"].isna() if step is None else res["step"] == step)]
            want = trace.heads_for("answer" if step is None else P + step, by=by, top=6)
            assert sel["rank"].tolist() == list(range(6))
            assert np.allclose(sel["share"], want["share"], atol=1e-5)
            assert (sel[["layer", "head", "source"]].to_numpy() == want[["layer", "head", "source"]].to_numpy()).all()


def test_repr_is_one_short_line_and_the_notebook_display_small(trace):
    r = repr(trace)
    assert "\n" not in r and len(r) < 200
    assert r.startswith("Trace(tiny-llama: ") and f"prompt {trace.prompt_length} + answer {N}" in r
    html = trace._repr_html_()
    assert len(html) < 20_000 and "explore-data" not in html and "to_html" in html
    inline = trace.explore()
    assert "srcdoc" in inline._repr_html_() and "\n" not in repr(inline)


def test_fallback_chat_template():
    handle = tiny_model("llama")                           # the tiny tokenizer has no chat template
    assert chat_template_of(handle) == "fallback"
    ids = prompt_ids(handle, "hi", chat=True, system="be brief")
    assert handle.tokenizer.decode(ids) == "System: be brief\n\nUser: hi\n\nAssistant:"
    assert "Assistant:" in FALLBACK_CHAT_TEMPLATE
    marked = template_positions(handle, "hi", chat=True, system="be brief")
    assert len(marked) == len(ids) - len("be brief") - len("hi")
    tr = analyze(handle, "hi", generate=2, chat=True, stop=())
    assert tr.template == template_positions(handle, "hi", chat=True) and len(tr.template) == tr.prompt_length - 2


# ---- what the API takes as a model ------------------------------------------------------------


def _public_functions():
    import importlib
    import pkgutil

    for m in pkgutil.iter_modules(attngeom.__path__):
        if not m.ispkg or m.name in ("commands", "reports"):
            continue
        pkg = importlib.import_module(f"attngeom.{m.name}")
        for name in pkg.__all__:
            obj = getattr(pkg, name)
            fn = obj if inspect.isfunction(obj) else vars(obj).get("__init__") if inspect.isclass(obj) else None
            if fn is None:
                continue
            params = list(inspect.signature(inspect.unwrap(fn)).parameters)
            params = params[1:] if inspect.isclass(obj) else params
            if params and params[0] in ("handle", "model"):
                yield f"{m.name}.{name}", fn, params[0]


EXEMPT = {"model.ModelHandle", "model.ArchitectureAdapter", "model.wrap"}
"""Classes built around a model, and wrap (which makes the handle from a model and its tokenizer)."""


def test_every_public_function_taking_a_model_checks_it():
    seen = 0
    for name, fn, param in _public_functions():
        if name in EXEMPT:
            continue
        flag = "takes_handle" if param == "handle" else "takes_model"
        assert getattr(fn, flag, False), f"{name} takes a {param} but is not decorated with {flag}"
        seen += 1
    assert seen >= 30                  # the enumeration reaches the public API (37 functions when written)


def test_a_bare_model_or_a_name_is_refused_in_one_line():
    handle = tiny_model("llama")
    for bad, hint in [(handle.model, "attngeom.wrap"), ("smollm2-135m", "attngeom.load_model('smollm2-135m')")]:
        for call in (lambda m: attngeom.analyze(m, "a b"), lambda m: attngeom.stream(m, ["a b"], []),
                     lambda m: attngeom.explorer.build(m, "a b"), lambda m: attngeom.kvcache.read_under_budget(m, [1, 2], "full", None)):
            with pytest.raises(InputError, match="ModelHandle that attngeom.load_model returns") as e:
                call(bad)
            assert hint in str(e.value) and "\n" not in str(e.value)


def test_functions_taking_a_transformers_model_accept_the_handle():
    from attngeom.kvcache import CompressedCache, compressing

    handle = tiny_model("llama")
    cache = CompressedCache(handle.config, "contribution", 4)
    ids = torch.tensor([handle.encode("hello world again")])
    with compressing(handle, cache):                         # the handle load_model returns
        out = handle.model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3
    assert attngeom.model.adapter_for(handle) is attngeom.model.adapter_for(handle.model)
    with pytest.raises(InputError, match="or its transformers model"):
        with compressing("smollm2-135m", cache):
            pass


def test_the_explorer_carries_each_heads_share_and_the_marks(trace):
    from attngeom.explorer.data import from_trace

    data = from_trace(trace)
    assert (data.special, data.template) == (list(trace.special), list(trace.template))
    for k, lt in enumerate(trace.layers):
        rows = data.rows["contribution_inter"][k].astype(np.float32)      # [H+1, T, T], float16 on the page
        H = lt.num_heads
        assert np.allclose(rows[:H], np.tril(lt.contribution_inter), atol=2e-3)
        assert np.allclose(rows[H], rows[:H].sum(0), atol=5e-3)            # the layer view: C_ij
    topk = from_trace(trace, exact_max_tokens=0)
    assert "contribution_inter" not in topk.rows                           # exact maps only
    with pytest.raises(InputError, match="exact maps only"):
        topk.sources(trace.layers[0].index, 0, 5, "contribution_inter")
