"""Generation with analysis: every decoding step (one query against the KV cache) equals the same
row of a full forward of prompt + answer; decoding matches ``model.generate``; answer tables agree
with a slow computation from the full trace; bad input is refused."""

import numpy as np
import pytest
import torch

from attngeom.errors import InputError
from attngeom.capture.kernel import GrowingTensor
from attngeom.capture.session import Session
from attngeom.generation.answers import AnswerSources
from attngeom.generation.decoding import (Decoding, GrowingCache, GrowingNorms, generate, generation_stage,
                                         stream_generation)
from attngeom.generation.prompts import prompt_ids
from attngeom.streaming.reducers import HeadStats, Reducer, TokenStats
from attngeom.traces.trace import Trace, analyze
from attngeom.streaming import stream as stream_texts
from checks import METRICS, metric_error as _close
from tiny_models import tiny_chat_tokenizer, tiny_model

PROMPT = "The cat sat"          # 12 tokens with BOS: longer than the tiny models' window of 8
N = 14


class StepRows(Reducer):
    """Keeps, per layer and query position, the metric rows of the block that held that query alone
    (a decoding step) or in the prompt's blocks: ``rows[(layer, q)][name] -> [H, S_total]``."""

    def __init__(self, T):
        self.T, self.rows, self.single = T, {}, set()

    def observe(self, block):
        B, H, Q, S = block.shape
        for r in range(Q):
            q = block.q_start + r
            if Q == 1:
                self.single.add((block.layer, q))
            out = {}
            for m in METRICS:
                row = np.zeros((H, self.T), dtype=np.float32)
                row[:, block.k_start:block.k_start + S] = block.metric(m)[0, :, r].cpu().numpy()
                out[m] = row
            self.rows[(block.layer, q)] = out


@pytest.mark.parametrize("arch, block_elements", [("llama", None), ("llama", 40), ("mistral", None),
                                                  ("gemma3_text", None), ("gemma2", None)])
def test_every_step_equals_the_full_forward_row(arch, block_elements):
    """llama: grouped-query attention (also with the prompt in blocks of a few queries); mistral:
    multi-query + sliding window 8 on every layer; gemma3: sliding/sliding/full layers with q/k
    norms; gemma2: soft-capping and a sliding layer."""
    handle = tiny_model(arch)
    ids = handle.encode(PROMPT)
    P = len(ids)
    if arch != "llama":
        assert P > handle.model.config.sliding_window                  # every step is past the window
    rows = StepRows(P + N)
    full_ids = stream_generation(handle, ids, [rows], Decoding(N, stop=()), block_elements=block_elements)
    T = len(full_ids)
    assert T == P + N
    full = analyze(handle, full_ids)                                  # one forward, no cache
    L = handle.num_layers
    # every generated position was computed as a decoding step of its own, in every layer
    assert rows.single >= {(l, q) for l in range(L) for q in range(P, T)}
    worst = {m: 0.0 for m in METRICS}
    for lt in full.layers:
        for q in range(T):
            for m in METRICS:
                worst[m] = max(worst[m], _close(rows.rows[(lt.index, q)][m], getattr(lt, m)[:, q], m))
    assert all(err < 1e-5 for err in worst.values()), (arch, worst)
    # the trace assembled from the steps is the full forward's
    gen = analyze(handle, ids, generate=N, stop=())
    assert gen.ids == full_ids and gen.prompt_length == P
    assert gen.generated.tolist() == [False] * P + [True] * N
    for a, b in zip(gen.layers, full.layers):
        for m in METRICS:
            assert _close(getattr(a, m), getattr(b, m), m) < 1e-5, (arch, a.index, m)


def test_long_generation_in_a_growing_cache_equals_the_full_forward():
    """200 tokens after the prompt, in a cache that starts with room for 4 tokens (it doubles six
    times): every step's five metrics equal the same row of one forward pass of prompt + answer, and
    the answer and every row are bit for bit those of transformers' DynamicCache, which
    reallocates the whole cache at every step."""
    from transformers import DynamicCache

    handle = tiny_model("llama")
    ids = handle.encode(PROMPT)
    P, n = len(ids), 200
    T = P + n

    def run(cache):
        rows = StepRows(T)
        session = Session(observers=[GrowingNorms(), rows])
        return ids + generate(handle, ids, Decoding(n, stop=()), session, cache=cache), rows

    grown, rows = run(GrowingCache(4))
    dynamic, ref = run(DynamicCache())
    assert grown == dynamic and len(grown) == T
    assert rows.rows.keys() == ref.rows.keys()
    for key, got in rows.rows.items():
        for m in METRICS:
            assert np.array_equal(got[m], ref.rows[key][m]), (key, m)
    full = analyze(handle, grown)
    worst = {m: 0.0 for m in METRICS}
    for lt in full.layers:
        for q in range(T):
            for m in METRICS:
                worst[m] = max(worst[m], _close(rows.rows[(lt.index, q)][m], getattr(lt, m)[:, q], m))
    # the model's own float32 forward, one token at a time or all at once, rounds differently: over
    # 200 steps the hidden states drift further than over 14 (worst measured ~1.1e-5, value_weighted)
    assert all(err < 5e-5 for err in worst.values()), worst


def test_growing_tensor_equals_concatenation_with_few_allocations():
    g, pieces, storages = GrowingTensor(2, capacity=3), [], set()
    for k in range(100):
        x = torch.randn(2, 3, 1 + k % 3, 4)
        pieces.append(x)
        out = g.append(x)
        storages.add(out.untyped_storage().data_ptr())
        assert torch.equal(out, torch.cat(pieces, dim=2))
    assert g.length == sum(p.shape[2] for p in pieces) == 199
    assert len(storages) <= 8                         # room for 3, 6, 12, ..., 384: doubling, not one per call
    g.truncate(10)
    assert torch.equal(g.tensor, torch.cat(pieces, dim=2)[:, :, :10])
    cache = GrowingCache(5)                           # crop, as the text reducers' call uses it
    handle = tiny_model("llama")
    ids = handle.encode(PROMPT)
    generate(handle, ids, Decoding(6, stop=()), cache=cache)
    keys = cache.layers[0].keys.clone()
    cache.crop(-4)
    assert cache.get_seq_length() == len(ids) + 2 and torch.equal(cache.layers[0].keys, keys[:, :, :len(ids) + 2])


def test_greedy_equals_model_generate():
    handle = tiny_model("qwen2")
    ids = handle.encode(PROMPT)
    with torch.no_grad():
        ref = handle.model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    trace = analyze(handle, PROMPT, generate=N)
    assert trace.ids == ref[0].tolist()
    assert handle.model.config._attn_implementation == "sdpa"             # restored afterwards


def test_sampling_is_reproducible_and_top_p_limits_it():
    handle = tiny_model("llama")
    ids = handle.encode(PROMPT)

    def run(**kw):
        return stream_generation(handle, ids, [], Decoding(24, stop=(), **kw))

    a, b = run(sample=True, seed=3), run(sample=True, seed=3)
    assert a == b
    assert run(sample=True, seed=4) != a                                # another seed, another answer
    assert run(sample=True) == run(sample=True, seed=0)                 # the default seed is 0
    # a nucleus smaller than any probability keeps the most probable token only: greedy
    assert run(sample=True, top_p=1e-9, seed=5) == run()
    hot = run(sample=True, temperature=50.0, seed=3)
    assert hot != run()


def test_stop_token_ends_the_answer_and_is_kept():
    handle = tiny_model("llama")
    ids = handle.encode(PROMPT)
    free = stream_generation(handle, ids, [], Decoding(N, stop=()))
    answer = free[len(ids):]
    stop_at = answer[3]
    got = stream_generation(handle, ids, [], Decoding(N, stop=(stop_at,)))
    first = answer.index(stop_at)
    assert got == free[:len(ids) + first + 1]


@pytest.mark.parametrize("arch, mode", [("gemma3_text", "steps"), ("gemma3_text", "text"), ("mistral", "text")])
def test_reducers_during_generation_equal_the_full_forward(arch, mode):
    """Reducers at every step, or as text reducers (the prompt's call, then the answer in one call
    against the cached prompt, beside AnswerSources at every step): the full forward's results."""
    handle = tiny_model(arch)
    ids = handle.encode(PROMPT)
    heads, tokens = HeadStats(), TokenStats()
    if mode == "steps":
        full_ids = stream_generation(handle, ids, [heads, tokens], Decoding(N, stop=()))
    else:
        T = len(ids) + N
        rows = StepRows(T)
        answer = AnswerSources()
        full_ids = stream_generation(handle, ids, [answer], Decoding(N, stop=()), text_reducers=[heads, tokens, rows])
        assert len(answer.result()["shares"]) == N * (handle.num_layers + 1)
        full = analyze(handle, full_ids)
        assert {q for _, q in rows.rows} == set(range(T))
        assert not rows.single                              # the answer's rows came in one call, not per step
        for lt in full.layers:
            for q in range(T):
                for m in METRICS:
                    assert _close(rows.rows[(lt.index, q)][m], getattr(lt, m)[:, q], m) < 1e-5, (lt.index, q, m)
    h2, t2 = HeadStats(), TokenStats()
    stream_texts(handle, [full_ids], [h2, t2], progress=False)
    a, b = heads.result(), h2.result()
    assert list(a.columns) == list(b.columns) and len(a) == len(b)
    num = [c for c in a.columns if c not in ("layer", "head", "queries")]
    assert np.allclose(a[num].to_numpy(), b[num].to_numpy(), atol=1e-5)
    assert (a["queries"] == b["queries"]).all()
    ta, tb = tokens.result(), t2.result()
    assert len(ta) == len(tb) == len(full_ids) * handle.num_layers
    num = [c for c in ta.columns if c not in ("text", "layer", "position", "token_id")]
    assert (ta["token_id"] == tb["token_id"]).all()
    assert np.allclose(ta[num].to_numpy(), tb[num].to_numpy(), rtol=1e-4, atol=1e-5)


def test_the_answer_tables_alone_run_as_many_forward_calls_as_model_generate():
    """The answer tables read producing rows only (READS_LAST_TOKEN False): N tokens cost N forward
    calls, as model.generate, and the tables equal those of a generation that also ran the last
    token for a reducer that reads it."""
    handle = tiny_model("llama")
    ids, N = handle.encode(PROMPT), 5
    stream_generation(handle, ids, [AnswerSources()], Decoding(1, stop=()))   # the adapter's probes run once, first
    calls = []
    hook = handle.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        alone, beside = AnswerSources(), AnswerSources()
        a_ids = stream_generation(handle, ids, [alone], Decoding(N, stop=()))
        assert len(calls) == N
        calls.clear()
        b_ids = stream_generation(handle, ids, [beside, HeadStats()], Decoding(N, stop=()))
        assert len(calls) == N + 1 and a_ids == b_ids
    finally:
        hook.remove()
    for name, table in alone.result().items():
        other = beside.result()[name]
        assert table.shape == other.shape and len(table), name
        num = table.select_dtypes("number").columns
        assert np.allclose(table[num].to_numpy(float), other[num].to_numpy(float), atol=1e-6, equal_nan=True), name


def test_an_observer_without_reads_last_token_counts_as_reading_it():
    """README: a reducer is any object with observe(block); one without READS_LAST_TOKEN gets every
    row, the last token's included."""
    handle = tiny_model("llama")
    ids, N = handle.encode(PROMPT), 3

    class Duck:
        def __init__(self):
            self.queries = set()

        def begin(self, batch):
            pass

        def observe(self, block):
            self.queries.update(range(block.q_start, block.q_start + block.shape[2]))

        def end(self, batch):
            pass

    duck = Duck()
    full = stream_generation(handle, ids, [duck, AnswerSources()], Decoding(N, stop=()))
    assert duck.queries == set(range(len(full)))


def test_a_growing_norms_reused_for_a_new_generation_starts_again():
    """A GrowingNorms that read the norms on the prompt's call only, then serves a generation with a
    longer prompt (more sources than the first generation ever held): the new prompt call has nothing
    cached before it, so the kept norms are dropped and recomputed, equal to the values' own."""
    handle = tiny_model("llama")
    norms = GrowingNorms()
    got = {}

    class ReadOnPrompt(Reducer):
        def observe(self, block):
            if block.shape[2] > 1:                                   # the prompt's call only
                got[block.layer] = (block.state.value_norm.clone(), block.state.v.clone(), block.state.G)

    for prompt, n in (("a b", 6), ("The cat sat on the mat again and again", 2)):
        ids = handle.encode(prompt)
        generate(handle, ids, Decoding(n, stop=()), Session(observers=[norms, ReadOnPrompt()]))
        for layer, (vn, v, G) in got.items():
            assert vn.shape[-1] == len(ids)
            assert torch.allclose(vn, ((v @ G) * v).sum(-1).clamp_min(0).sqrt(), atol=1e-5), (prompt, layer)


def test_answer_sources_on_one_layer_reduce_each_steps_row_before_the_next():
    """Observing a single layer, a step's row still leaves the device when the next call begins:
    the rows waiting never hold more than one call's."""
    handle = tiny_model("llama")
    waiting = []

    class Counting(AnswerSources):
        def observe(self, block):
            super().observe(block)
            waiting.append(len(self._step))

    tables = Counting()
    stream_generation(handle, handle.encode(PROMPT), [tables], Decoding(6, stop=()), layers=[1])
    assert max(waiting) == 1 and len(waiting) >= 6
    assert len(tables.result()["shares"]) == 6 * 2                   # layer 1 and the model, per token


def _slow_answer_tables(trace: Trace, sink: int, top_k: int):
    """Shares and top sources of each producing row, from the full trace's maps."""
    P, T = trace.prompt_length, len(trace.ids)
    per_layer = {lt.index: {"attention": lt.attention.mean(0).astype(np.float64),
                            "contribution": lt.contribution_inter.sum(0).astype(np.float64)}
                 for lt in trace.layers}
    per_layer[None] = {m: np.mean([per_layer[l][m] for l in per_layer], axis=0) for m in ("attention", "contribution")}
    shares, sources = {}, {}
    for layer, maps in per_layer.items():
        for q in range(P - 1, T - 1):
            for m, x in maps.items():
                row = x[q, :q + 1]
                shares[(layer, q, m)] = (row[sink], row[:P].sum() - row[sink], row[P:].sum())
                cand = [j for j in range(q + 1) if j != sink]      # the prompt and the earlier answer
                sources[(layer, q, m)] = sorted(cand, key=lambda j: (-row[j], j))[:top_k]
    return shares, sources


def test_answer_tables_against_the_full_trace():
    handle = tiny_model("mistral")
    trace = analyze(handle, PROMPT, generate=N, stop=())
    tables = AnswerSources(top_k=4)
    stream_generation(handle, trace.ids[:trace.prompt_length], [tables], Decoding(N, stop=()))
    res = tables.result()
    shares, sources = _slow_answer_tables(trace, sink=0, top_k=4)
    P, L = trace.prompt_length, handle.num_layers
    sh = res["shares"]
    assert len(sh) == N * (L + 1) and sh["layer"].isna().sum() == N
    for _, r in sh.iterrows():
        layer = None if r["layer"] is pd_na() else int(r["layer"])
        assert r["position"] == r["query"] + 1 and r["token_id"] == trace.ids[r["position"]]
        for m in ("attention", "contribution"):
            want = shares[(layer, r["query"], m)]
            got = (r[f"{m}_sink"], r[f"{m}_prompt"], r[f"{m}_answer"])
            assert np.allclose(got, want, atol=1e-5), (layer, r["query"], m)
            assert abs(sum(got) - 1) < 1e-4                     # both token-level rows sum to 1
    assert (sh.loc[sh["step"] == 0, ["attention_answer", "contribution_answer"]].abs() < 1e-6).all().all()
    src = res["sources"]
    for (layer, q, m), want in sources.items():
        sel = src[(src["query"] == q) & (src["metric"] == m)
                  & (src["layer"].isna() if layer is None else src["layer"] == layer)].sort_values("rank")
        # scores equal up to float noise; ties may order either way only when the scores tie
        assert len(sel) == len(want)
        maps = {lt.index: lt for lt in trace.layers}
        assert (sel["source"] <= q).all() and (sel["source"] != 0).all()
        assert (np.diff(sel["score"].to_numpy()) <= 1e-6).all()
        if layer is not None:
            x = maps[layer].attention.mean(0) if m == "attention" else maps[layer].contribution_inter.sum(0)
            assert np.allclose(sel["score"], x[q, sel["source"].to_numpy()], atol=1e-5)
            assert np.allclose(np.sort(sel["score"].to_numpy()), np.sort(x[q, want]), atol=1e-5)
    summ = res["summary"]
    assert len(summ) == P * (L + 1)
    for layer in range(L):
        lt = trace.layers[layer]
        got = summ[summ["layer"] == layer].sort_values("position")["contribution"].to_numpy()
        want = lt.contribution_inter.sum(0)[P - 1:-1, :P].mean(0)
        assert np.allclose(got, want, atol=1e-5)


def test_answer_top_sources_break_ties_by_the_earlier_position():
    from attngeom.generation.decoding import GenerationBatch

    tables = AnswerSources(top_k=3)
    tables.begin(GenerationBatch(ids=torch.arange(12)[None], lengths=torch.tensor([12]), index=[0], prompt_length=8))
    row = np.array([[0.5, 0.1, 0.3, 0.3, 0.3, 0.0, 0.3, 0.2, 0.9],             # the sink (0) left out; the answer
                    [0.0, 0.2, 0.1, 0.4, 0.1, 0.4, 0.1, 0.4, 0.0]])            # token 8 is a source like the prompt's
    got = {m: [(int(j), float(x)) for j, x in zip(*top)] for m, top in zip(("attention", "contribution"), tables._top(row))}
    assert got == {"attention": [(8, 0.9), (2, 0.3), (3, 0.3)], "contribution": [(3, 0.4), (5, 0.4), (7, 0.4)]}


def pd_na():
    import pandas as pd

    return pd.NA


def test_generation_stage_merges_records(tmp_path):
    handle = tiny_model("llama")
    prompts = [handle.encode(t) for t in ("ab", "The cat sat", "xyz w")]
    dec = Decoding(5, stop=())
    merged = generation_stage(handle, None, "generate", prompts, dec, lambda: [AnswerSources()])[0].result()
    for u, p in enumerate(prompts):
        one = AnswerSources()
        stream_generation(handle, p, [one], dec, index=u)
        a = merged["shares"][merged["shares"]["text"] == u].reset_index(drop=True)
        b = one.result()["shares"]
        assert a.equals(b)


def test_trace_of_a_generation_saves_and_loads(tmp_path):
    handle = tiny_model("qwen2")
    trace = analyze(handle, PROMPT, generate=4, stop=())
    back = Trace.load(trace.save(tmp_path / "t"))
    assert back.prompt_length == trace.prompt_length and back.ids == trace.ids
    assert np.array_equal(back.layers[1].contribution, trace.layers[1].contribution)
    assert Trace.load(analyze(handle, PROMPT).save(tmp_path / "u")).prompt_length is None


# ------------------------------------------------------------------------------------------------
# Chat prompts
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_handle():
    handle = tiny_model("llama")
    handle.tokenizer = tiny_chat_tokenizer()
    return handle


def test_chat_prompt_goes_through_the_template(chat_handle):
    tok = chat_handle.tokenizer
    ids = prompt_ids(chat_handle, "hi", chat=True, system="be brief")
    text = "<s>system: be brief</s>\n<s>user: hi</s>\n<s>assistant:"
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "more"}]
    ids = prompt_ids(chat_handle, msgs)
    assert tok.decode(ids) == "<s>user: hi</s>\n<s>assistant: ok</s>\n<s>user: more</s>\n<s>assistant:"
    trace = analyze(chat_handle, "hi", generate=3, chat=True, stop=())
    assert trace.ids[:trace.prompt_length] == prompt_ids(chat_handle, "hi", chat=True)
    # an assistant message at the end is continued, not closed
    cont = prompt_ids(chat_handle, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "o"}])
    assert tok.decode(cont).endswith("assistant: o")


@pytest.mark.parametrize("kwargs, match", [
    (dict(generate=0), "at least 1"),
    (dict(generate=-3), "at least 1"),
    (dict(generate=300), "past tiny-llama's context of 256"),
    (dict(generate=2, temperature=0.5), "add --sample"),
    (dict(generate=2, sample=True, temperature=0.0), "temperature"),
    (dict(generate=2, sample=True, top_p=1.5), "top-p"),
    (dict(generate=2, system="x"), "needs chat=True"),
    (dict(seed=1), "give generate=N"),
])
def test_bad_generation_input_refused(kwargs, match):
    handle = tiny_model("llama")
    with pytest.raises(InputError, match=match):
        analyze(handle, PROMPT, **kwargs)


def test_stop_token_in_the_prompt_refused(chat_handle):
    with pytest.raises(InputError, match="stop token '</s>'"):
        analyze(chat_handle, "before </s> after", generate=2)
    with pytest.raises(InputError, match="stop token"):
        analyze(chat_handle, [{"role": "user", "content": "a</s>b"}], generate=2)
    # the template's own </s> between messages is the model's format, not the user's text
    assert len(analyze(chat_handle, "fine", generate=2, chat=True).ids) > 2
    # with no stop tokens nothing is refused
    assert analyze(chat_handle, "before </s> after", generate=2, stop=()).prompt_length > 0


@pytest.mark.parametrize("exact_max_tokens", [512, 0])
def test_explorer_of_a_generation_equals_the_explorer_of_its_text(exact_max_tokens):
    """The explorer's collectors observing the steps give the page a full forward of the same ids gives."""
    from attngeom.explorer.data import build

    handle = tiny_model("gemma3_text")
    gen = build(handle, PROMPT, decoding=Decoding(N, stop=()), exact_max_tokens=exact_max_tokens)
    ref = build(handle, gen.ids, exact_max_tokens=exact_max_tokens)
    P = len(handle.encode(PROMPT))
    assert gen.T == ref.T == P + N and gen.answer["prompt_length"] == P and ref.answer is None
    assert gen.top_k == ref.top_k
    for m in ("attention", "contribution"):
        for x, y in zip(gen.rows[m], ref.rows[m]):
            if gen.exact:
                assert x.shape == y.shape and np.abs(x.astype(np.float32) - y.astype(np.float32)).max() < 2e-3
            else:
                assert (x[0] == y[0]).mean() > 0.99          # the same sources, but for near-ties
                assert np.abs(x[1].astype(np.float32) - y[1].astype(np.float32)).max() < 2e-2
    assert np.allclose(gen.residual_share, ref.residual_share, atol=2e-4)
    for k in gen.head_stats:
        if k == "direct_effect":        # at the page's first query: the prompt's last row here, the text's last in ref
            continue
        assert np.allclose(gen.head_stats[k], ref.head_stats[k], atol=1e-4), k
    from attngeom.generation.effects import Answer, direct_effects

    want, _ = direct_effects(handle, gen.ids[:P], Answer(handle, gen.ids[P]))
    assert np.allclose(gen.head_stats["direct_effect"], want, atol=1e-6)
    # the answer summary: mean C_ij over the producing rows, from the full trace
    trace = analyze(handle, gen.ids)
    C = np.stack([lt.contribution_inter.sum(0) for lt in trace.layers])
    assert np.allclose(gen.answer["layers"]["contribution"], C[:, P - 1:-1, :P].mean(1), atol=1e-5)
    assert np.allclose(gen.answer["model"]["contribution"], C[:, P - 1:-1, :P].mean((0, 1)), atol=1e-5)
    # a generation's Trace gives the same answer view (Trace.to_html)
    from attngeom.explorer.data import from_trace

    tr = analyze(handle, PROMPT, generate=N, stop=())
    assert tr.ids == gen.ids
    view = from_trace(tr, exact_max_tokens=exact_max_tokens)
    assert view.answer["prompt_length"] == P
    for m in ("attention", "contribution"):
        assert np.allclose(view.answer["model"][m], gen.answer["model"][m], atol=1e-5)
        assert np.allclose(view.answer["layers"][m], gen.answer["layers"][m], atol=1e-5)


def test_device_generation_is_exact(test_device):
    """On ``$ATTNGEOM_TEST_DEVICE`` (benchmarks/gpu_check.sh: cuda): greedy steps equal
    model.generate, each step's rows equal one forward pass, and a seeded sample repeats."""
    handle = tiny_model("mistral")
    handle.model.to(test_device)
    ids = handle.encode(PROMPT)
    rows = StepRows(len(ids) + 8)
    full_ids = stream_generation(handle, ids, [rows], Decoding(8, stop=()))
    with torch.no_grad():
        ref = handle.model.generate(torch.tensor([ids], device=test_device), max_new_tokens=8, min_new_tokens=8,
                                    do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                                               device=test_device))
    assert full_ids == ref[0].tolist()
    full = analyze(handle, full_ids)
    for lt in full.layers:
        for q in range(len(ids), len(full_ids)):
            for m in METRICS:
                assert _close(rows.rows[(lt.index, q)][m], getattr(lt, m)[:, q], m) < 1e-4, (lt.index, q, m)
    a = stream_generation(handle, ids, [], Decoding(8, sample=True, seed=11, stop=()))
    assert a == stream_generation(handle, ids, [], Decoding(8, sample=True, seed=11, stop=()))
def test_generation_progress_counts_tokens(capsys):
    """The bar counts generated tokens (not prompts), on stderr, and only when asked for."""
    from attngeom.generation.decoding import stream_generation_ids

    handle = tiny_model("llama")
    ids = handle.encode("The cat sat")
    stream_generation_ids(handle, ids, [], Decoding(5, stop=()), progress=True)
    err = capsys.readouterr().err
    assert "generating" in err and "0/5" in err and "token/s" in err     # a total of 5 tokens, not 1 prompt
    stream_generation_ids(handle, ids, [], Decoding(5, stop=()))
    assert capsys.readouterr().err == ""
