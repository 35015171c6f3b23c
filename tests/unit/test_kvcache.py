"""The compressed KV cache (attngeom.kvcache.cache), its policies (attngeom.kvcache.policies), the evaluation under a budget (attngeom.kvcache.evaluation) and `attngeom kvcache`."""


import numpy as np
import pandas as pd
import pytest
import torch
from transformers import DynamicCache

from attngeom.capture import Session
from attngeom.kvcache.cache import CacheScorer, CompressedCache, cache_bytes, cached_forward, compressing, kept_entries, new_cache, pool_heads
from attngeom.kvcache.evaluation import read_under_budget
from attngeom.kvcache.policies import taxonomy_budgets
from attngeom.kvcache.policies import POLICIES, EvictionContext, get_policy
from tiny_models import eager_attentions, tiny_model

T = 24


def _ids(n=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 128, (n,), generator=g).tolist()


def _read_logits(handle, cache, ids, chunk, session=None):
    with torch.no_grad(), compressing(handle.model, cache, session):
        return torch.cat([cached_forward(handle, cache, torch.tensor([ids[s:s + chunk]])) for s in range(0, len(ids), chunk)], dim=1)


# ---------------------------------------------------------------------------------------------
# exactness: a budget at least the length is the full cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma", "qwen3", "gemma3_text"])  # GQA, MHA, head_dim != hidden/heads, hybrid
@pytest.mark.parametrize("chunk", [1, 5])
def test_budget_at_least_length_equals_full_cache(arch, chunk):
    h = tiny_model(arch)
    ids = _ids()
    whole = h.model(input_ids=torch.tensor([ids])).logits.float()
    ref = _read_logits(h, DynamicCache(config=h.model.config), ids, chunk, None)
    for name in ("window", "streamingllm"):                          # no scores: the same SDPA calls
        got = _read_logits(h, CompressedCache(h.model.config, name, T), ids, chunk, None)
        assert torch.equal(got, ref), name
    for name in ("h2o", "contribution", "taxonomy", "snapkv"):       # scored: the same exact capture
        got = _read_logits(h, CompressedCache(h.model.config, name, T), ids, chunk)
        full = DynamicCache(config=h.model.config)
        ref_s = _read_logits(h, full, ids, chunk, Session(observers=[CacheScorer(full)]))
        assert torch.equal(got, ref_s), name
        assert torch.allclose(got, whole, atol=1e-4), name
    assert torch.allclose(ref, whole, atol=1e-4)


def test_full_policy_reads_like_one_forward():
    h = tiny_model("llama")
    ids = _ids()
    with torch.no_grad():
        logits = h.model(input_ids=torch.tensor([ids])).logits.float()[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
    r = read_under_budget(h, ids, "full", None)
    assert r["tokens"] == T - 1 and abs(r["nll"] - float(nll)) < 1e-3


# ---------------------------------------------------------------------------------------------
# eviction: at most `budget` entries per head, memory really freed, heads keep different positions
# ---------------------------------------------------------------------------------------------


def test_eviction_bounds_entries_and_frees_storage():
    h = tiny_model("llama")                                          # 3 layers, 4 query / 2 kv heads, d 16
    ids, budget = _ids(40), 8
    cache = CompressedCache(h.model.config, "h2o", budget)
    with torch.no_grad(), compressing(h.model, cache):
        for s in range(len(ids)):
            cached_forward(h, cache, torch.tensor([ids[s:s + 1]]))
            for layer in cache.layers:
                assert layer.size <= budget and layer.keys.shape[2] == layer.size
    d = h.head_dim
    # storages, not views: exactly budget entries of keys and values per layer
    assert cache_bytes(cache) == 3 * 2 * (1 * 2 * budget * d * 4)
    pos = cache.layers[0].pos[0]
    assert not torch.equal(pos[0], pos[1]) or not torch.equal(cache.layers[1].pos[0, 0], cache.layers[1].pos[0, 1])
    assert int(pos[:, -1].min()) == len(ids) - 1                     # the newest token is always there
    full = read_under_budget(h, ids, "full", None)
    comp = read_under_budget(h, ids, "h2o", budget)
    assert comp["peak_bytes"] == cache_bytes(cache)
    assert full["peak_bytes"] == 3 * 2 * (2 * (len(ids) - 1) * d * 4)


def test_chunk_must_leave_room():
    h = tiny_model("llama")
    with pytest.raises(Exception, match="chunk"):
        read_under_budget(h, _ids(), "h2o", 4, chunk=4)


# ---------------------------------------------------------------------------------------------
# the policies on hand-computed cases (one head, positions 0..9, budget 6, one new token: keep 5)
# ---------------------------------------------------------------------------------------------


def _ctx(score, values=None, budget=6, n_kv=1, streaming=None):
    score = torch.as_tensor(score, dtype=torch.float32).reshape(1, n_kv, -1)
    n = score.shape[-1]
    pos = torch.arange(n).expand(1, n_kv, n)
    v = torch.ones(1, n_kv, n, 2) if values is None else torch.as_tensor(values, dtype=torch.float32).reshape(1, n_kv, n, -1)
    budget = torch.as_tensor(budget).reshape(-1).expand(n_kv).clone()
    return EvictionContext(pos=pos, valid=torch.ones_like(pos, dtype=torch.bool), score=score, values=v, seen=n,
                           budget=budget, streaming=None if streaming is None else torch.tensor(streaming))


def _kept(policy, ctx, keep=5):
    idx, ok = kept_entries(policy, ctx, torch.as_tensor(keep).reshape(-1).expand(ctx.pos.shape[1]))
    return [[int(p) for p, o in zip(ctx.pos[0, h].gather(-1, idx[0, h]), ok[0, h]) if o] for h in range(idx.shape[1])]


S = [5, 0, 1, 9, 0, 0, 8, 0, 0, 0]


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_registered_policy_has_the_properties_the_cache_relies_on(name):
    """What every entry of the registry satisfies, whatever it is: a policy added to POLICIES is held
    to these without editing this test (its selection is checked by test_kvcompress's tests over POLICIES)."""
    from attngeom.kvcache.policies import READING_POLICIES, Policy

    policy = get_policy(name)
    assert isinstance(policy, Policy) and policy.name == name and get_policy(name).name == name
    assert policy.doc.strip()                                         # says what it keeps (and whose method it is)
    assert policy.needs in (None, "attention", "contribution", "leave_one_out", "leave_one_out_head", "reconstruction")
    assert policy.pool in ("mean", "max", "layer")
    assert policy.last is None or (isinstance(policy.last, int) and policy.last > 0)
    assert isinstance(policy.accumulate, bool) and isinstance(policy.prefill_only, bool)
    if name in READING_POLICIES:                                      # reads with eviction at every step
        assert not policy.prefill_only


def test_the_reading_policies_are_registered_and_unknown_names_refused():
    from attngeom.kvcache.policies import READING_POLICIES

    assert READING_POLICIES and set(READING_POLICIES) <= set(POLICIES)
    with pytest.raises(Exception, match="unknown KV-cache policy"):
        get_policy("nope")


def test_window_keeps_the_most_recent():
    assert _kept(get_policy("window"), _ctx(S)) == [[5, 6, 7, 8, 9]]


def test_full_never_evicts():
    h = tiny_model("llama")
    assert type(new_cache(h, get_policy("full"), 4)) is DynamicCache


def test_streamingllm_keeps_sinks_and_window():
    from attngeom.kvcache.policies import streamingllm

    assert _kept(streamingllm(sinks=2), _ctx(S)) == [[0, 1, 7, 8, 9]]
    assert _kept(get_policy("streamingllm"), _ctx(S)) == [[0, 1, 2, 3, 9]]    # 4 sinks + 1 recent


def test_h2o_heavy_hitters_plus_recent_half():
    # recent = int(6 * 0.5) = 3 -> positions 7, 8, 9; then the two largest scores: 3 (9) and 6 (8)
    assert _kept(get_policy("h2o"), _ctx(S)) == [[3, 6, 7, 8, 9]]


def test_tova_layer_mean_of_heads():
    # two kv heads, four query heads: the layer mean of the query heads decides for both kv heads
    q = torch.tensor([[0, 4, 0, 0, 1, 0], [0, 0, 0, 0, 1, 0], [3, 0, 0, 0, 1, 0], [0, 0, 0, 2, 1, 0.]])[None]
    pooled = pool_heads(q, 2, "layer")                               # [0.75, 1, 0, 0.5, 1, 0]
    assert torch.allclose(pooled[0, 0], torch.tensor([0.75, 1, 0, 0.5, 1, 0]))
    kept = _kept(get_policy("tova"), _ctx(pooled[0], n_kv=2, budget=4), keep=3)
    assert kept == [[0, 1, 4], [0, 1, 4]]
    assert torch.allclose(pool_heads(q, 2, "mean")[0, 1], torch.tensor([1.5, 0, 0, 1, 1, 0]))
    assert torch.allclose(pool_heads(q, 2, "max")[0, 0], torch.tensor([0, 4, 0, 0, 1, 0.]))


def test_snapkv_pools_neighbours_and_keeps_the_observation_window():
    from attngeom.kvcache.policies import snapkv

    s = [0, 0, 6, 9, 0, 0, 3, 0, 9, 9]
    # the window (8, 9) kept; the others average-pooled with kernel 3, the window and the ends as zeros
    # (kvpress's SnapKVPress): [0, 2, 5, 5, 3, 1, 1, 1, -, -]: then 2, 3 (5, 5), 4 (3)
    assert _kept(snapkv(window=2, kernel=3), _ctx(s)) == [[2, 3, 4, 8, 9]]
    from attngeom.kvcache.policies import _avg_pool

    ctx = _ctx(s)
    pooled = _avg_pool(ctx.score, ctx.valid, 3, ctx.recent(2))[0, 0, :8]
    assert torch.allclose(pooled, torch.tensor([0, 6, 15, 15, 9, 3, 3, 3]) / 3.0)        # max-pooling: 6, 9, 9, 9


def test_vatp_weights_attention_by_value_l1_norm():
    acc = [1.0] * 10
    values = [[float(j), -float(j)] for j in range(10)]            # |v_j|_1 = 2j
    # sink 0, recent 7..9, then the largest 2j * 1 among 1..6: 6
    assert _kept(get_policy("vatp"), _ctx(acc, values)) == [[0, 6, 7, 8, 9]]
    assert _kept(get_policy("h2o"), _ctx(acc, values)) == [[0, 1, 7, 8, 9]]   # ties: earliest


class _FakeBlock:
    def __init__(self, a, c, q_start=0):
        self.a, self.contribution, self.q_start = a, c, q_start


def test_contribution_absolute_keeps_suppressors_signed_drops_them():
    a = torch.tensor([0.5, 0.3, 0.2]).reshape(1, 1, 1, 3)
    c = torch.tensor([[-0.4, 0.9, 0.5], [0.1, 0.2, 0.7]]).reshape(1, 1, 2, 3)   # two queries
    blk = _FakeBlock(a, c)
    assert torch.allclose(get_policy("contribution").step(blk, 2), torch.tensor([[[0.5, 1.1, 1.2]]]))
    assert torch.allclose(get_policy("contribution_signed").step(blk, 2), torch.tensor([[[-0.3, 1.1, 1.2]]]))
    assert torch.allclose(get_policy("h2o").step(blk, 1), torch.tensor([[[0.5, 0.3, 0.2]]]))
    # keep 1 of 3 old entries (budget 4: recent = 2 -> entry 2 protected... use budget 2: recent 1)
    score_abs = [1.5, 1.1, 0.0, 0.0]
    score_signed = [-1.5, 1.1, 0.0, 0.0]
    assert _kept(get_policy("contribution"), _ctx(score_abs, budget=2), keep=2) == [[0, 3]]
    assert _kept(get_policy("contribution_signed"), _ctx(score_signed, budget=2), keep=2) == [[1, 3]]


def test_snapkv_and_tova_read_only_the_last_queries():
    a = torch.arange(12, dtype=torch.float32).reshape(1, 1, 4, 3)
    blk = _FakeBlock(a, None, q_start=4)                              # queries 4..7 of a pass of 8
    assert torch.equal(get_policy("tova").step(blk, 8), a[:, :, 3])
    assert get_policy("tova").step(_FakeBlock(a, None, q_start=0), 8) is None
    from attngeom.kvcache.policies import snapkv

    assert torch.equal(snapkv(window=2).step(blk, 8), a[:, :, 2:].sum(2))


def test_taxonomy_streaming_heads_keep_sinks_and_window_retrievers_h2o():
    from attngeom.kvcache.policies import taxonomy

    s = [5, 0, 1, 9, 0, 0, 8, 0, 0, 0]
    ctx = _ctx([s, s], n_kv=2, budget=[4, 8], streaming=[True, False])
    # head 0 (streaming, budget 4, keep 3): sink 0 then 8, 9; head 1 (H2O, budget 8, keep 7): recent 4 -> 6..9,
    # then the largest scores among 0..5: 3 (9), 0 (5), 2 (1)
    assert _kept(taxonomy(sinks=1), ctx, keep=[3, 7]) == [[0, 8, 9], [0, 2, 3, 6, 7, 8, 9]]


def test_taxonomy_budgets_share_the_layer_total():
    regimes = pd.DataFrame({"layer": [0] * 4 + [1] * 4, "head": [0, 1, 2, 3] * 2,
                            "regime": ["Mixer", "Reset", "Retriever", "Mixer", "Mixer", "Mixer", "Reset", "Mixer"]})
    budgets, streaming = taxonomy_budgets(regimes, num_heads=4, num_kv_heads=2, budget=64)
    # layer 0: kv head 1 (query heads 2, 3) has a Retriever: small = max(8, 16) = 16, large = 128 - 16
    assert budgets[0] == [16, 112] and streaming[0] == [True, False]
    assert budgets[1] == [64, 64] and streaming[1] == [True, True]
    # a chunk of 16 needs room: the small heads get 4 sinks + 16
    assert taxonomy_budgets(regimes, 4, 2, 64, chunk=16)[0][0] == [20, 108]


# ---------------------------------------------------------------------------------------------
# scores recorded during the forward pass against independent computations
# ---------------------------------------------------------------------------------------------


def test_recorded_scores_match_eager_attention_and_trace_contributions():
    from attngeom import analyze

    h = tiny_model("llama")
    ids = _ids(12)
    att = eager_attentions(h, ids)
    trace = analyze(h, torch.tensor(ids))
    for name in ("h2o", "contribution", "contribution_signed"):
        cache = CompressedCache(h.model.config, name, 64)
        _read_logits(h, cache, ids, 1)
        for l, layer in enumerate(cache.layers):
            layer._fold()
            if name == "h2o":
                want = att[l][0].float().sum(1)                                    # Σ_i a_ij per query head
            else:
                c = torch.as_tensor(np.asarray(trace.layers[l].contribution))      # [H, T, T]
                want = (c if name == "contribution_signed" else c.abs()).sum(1)
            assert torch.allclose(layer.acc[0], want, atol=1e-5), (name, l)


def test_chunked_reading_moves_perplexity_by_a_measured_amount():
    """C = 1 is the reference. At a budget >= the length, C changes nothing; below it, a chunk of C
    tokens is read with C - 1 fewer old entries per head. Measured on the tiny random Llama (64
    tokens, seed 1): at budget 32 (half the text) C = 2 moves perplexity by at most 11 % (window
    +2 %, StreamingLLM -2 %, H2O -11 %, contribution -8 %); at budget 16 C = 8 moves it by up to
    37 % (H2O), so a chunk must stay small against the budget (docs/kvcache.md)."""
    h = tiny_model("llama")
    ids = _ids(64, seed=1)
    for name in ("window", "streamingllm", "h2o", "contribution"):
        assert abs(read_under_budget(h, ids, name, 64, chunk=8)["nll"] - read_under_budget(h, ids, name, 64)["nll"]) < 1e-3
        one = read_under_budget(h, ids, name, 32)["nll"]
        two = read_under_budget(h, ids, name, 32, chunk=2)["nll"]
        change = abs(np.exp((two - one) / 63) - 1)
        assert 0 < change < 0.15, (name, change)


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


def test_per_head_budgets_pad_smaller_heads_and_the_padding_is_invisible():
    h = tiny_model("llama")                                          # 2 kv heads
    ids = _ids(30)
    budgets = {l: [6, 16] for l in range(3)}
    streaming = {l: [True, False] for l in range(3)}
    caches = [CompressedCache(h.model.config, "taxonomy", 16, budgets, streaming) for _ in range(2)]
    outs = [[], []]
    for s in range(len(ids)):
        for k in (0, 1):
            with torch.no_grad(), compressing(h.model, caches[k]):
                outs[k].append(cached_forward(h, caches[k], torch.tensor([ids[s:s + 1]])))
        for layer in caches[1].layers:                                 # garbage in the padding of one copy
            if layer.valid is not None:
                pad = ~layer.valid[..., None]
                layer.keys = layer.keys.masked_fill(pad, 1e4)
                layer.values = layer.values.masked_fill(pad, 1e4)
    layer = caches[0].layers[0]
    assert layer.valid is not None and layer.size == 16
    assert layer.valid[0].sum(-1).tolist() == [6, 16]
    assert layer.pos[0, 0][layer.valid[0, 0]].tolist() == [0, 1, 2, 3, 28, 29]   # 4 sinks + the 2 newest
    assert torch.equal(torch.cat(outs[0], 1), torch.cat(outs[1], 1))


def test_answers_agree_with_the_full_cache_when_nothing_is_evicted():
    from attngeom.kvcache.evaluation import answer_under_budget, answers, summarize_answers

    h = tiny_model("llama")
    prompt, ref = _ids(12, seed=3), _ids(5, seed=4)
    with torch.no_grad():
        logits = h.model(input_ids=torch.tensor([prompt + ref])).logits.float()[0]
    want = float(-torch.log_softmax(logits[11:16], -1)[torch.arange(5), torch.tensor(ref)].sum())
    full = answer_under_budget(h, prompt, ref, "full", None, new_tokens=6)
    assert abs(full["ref_nll"] - want) < 1e-3 and len(full["generated"].split()) == 6
    examples = [(prompt, ref), (_ids(10, seed=5), _ids(4, seed=6))]
    df = answers(h, None, examples, ["h2o", "streamingllm"], [4, 32], new_tokens=6)
    big = df[df.budget == 32]
    assert (big.match == 1).all() and (big.first_divergence == 6).all()
    assert np.allclose(big.groupby("example").ref_nll.std().fillna(0), 0, atol=1e-4)
    small = df[(df.budget == 4) & (df.policy != "full")]
    assert not np.allclose(small.ref_nll.to_numpy(), big[big.policy != "full"].ref_nll.to_numpy())
    s = summarize_answers(df)
    assert len(s) == 3 * 2 and (s[s.budget == 32].match == 1).all()
    # 2 examples are too few for an interval: none is given
    assert s[["match_low", "match_high", "ref_ppl_low", "ref_delta_high"]].isna().all().all()


def test_generate_with_the_compressed_cache():
    """transformers' generate() with the cache: equal to the full cache's greedy tokens when nothing
    is evicted, and bounded by the budget (plain SDPA: the cache's mask sizes are the kept entries)."""
    h = tiny_model("llama")
    prompt = torch.tensor([_ids(10, seed=7)])
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = h.model.generate(prompt, **kw)
    for name in ("streamingllm", "h2o"):
        cache = CompressedCache(h.model.config, name, 32)
        with compressing(h.model, cache):
            got = h.model.generate(prompt, cache=cache, **kw)
        assert torch.equal(got, want), name
        small = CompressedCache(h.model.config, name, 6)
        with compressing(h.model, small):
            h.model.generate(prompt, cache=small, **kw)
        assert all(layer.size <= 6 for layer in small.layers) and small.layers[0].seen == 10 + 11
    small = CompressedCache(h.model.config, "streamingllm", 6)
    sdpa = h.model.config._attn_implementation
    h.model.set_attn_implementation("sdpa")
    try:
        h.model.generate(prompt, cache=small, **kw)
    finally:
        h.model.set_attn_implementation(sdpa)
    assert all(layer.size <= 6 for layer in small.layers)
    beams = dict(kw, num_beams=3, num_return_sequences=2)                # batch reordering of every per-row tensor
    cache = CompressedCache(h.model.config, "h2o", 32)
    with compressing(h.model, cache):
        got = h.model.generate(prompt, cache=cache, **beams)
    assert torch.equal(got, h.model.generate(prompt, **beams))
    scored = CompressedCache(h.model.config, "h2o", 6)                   # scores need compressing()
    with pytest.raises(RuntimeError, match="compressing"):
        h.model.generate(prompt, cache=scored, **kw)


def test_hybrid_models_compress_only_their_full_attention_layers():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from attngeom.kvcache.cache import CompressedLayer

    h = tiny_model("gemma3_text")                                    # sliding, sliding, full (window 8)
    cache = CompressedCache(h.model.config, "contribution", 6)
    logits = _read_logits(h, cache, _ids(30), 2)
    assert torch.isfinite(logits).all()
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicSlidingWindowLayer, DynamicSlidingWindowLayer, CompressedLayer]
    assert cache.layers[2].size <= 6 and cache.layers[2].seen == 30


def test_pairwise_differences_on_shared_resamples():
    from attngeom.kvcache.evaluation import pairwise

    # policy a is better than b in every window: it wins every resample; deltas are antisymmetric
    na = 10.0 + np.arange(10) % 3
    nb = na + 1.0 + 0.1 * np.arange(10)
    df = pd.DataFrame({"window": list(range(10)) * 2, "policy": ["a"] * 10 + ["b"] * 10, "budget": 8,
                       "nll": np.concatenate([na, nb]), "tokens": [10] * 20})
    p = pairwise(df, n_resamples=200).set_index(["a", "b"])
    want = np.exp(na.sum() / 100) - np.exp(nb.sum() / 100)
    assert np.isclose(p.loc[("a", "b"), "delta_ppl"], want) and np.isclose(p.loc[("b", "a"), "delta_ppl"], -want)
    assert p.loc[("a", "b"), "a_better"] == 1 and p.loc[("b", "a"), "a_better"] == 0
    assert p.loc[("a", "b"), "delta_low"] <= want <= p.loc[("a", "b"), "delta_high"] < 0


def test_two_windows_give_no_interval():
    from attngeom.kvcache import pairwise, summarize

    df = pd.DataFrame({"window": [0, 1] * 2, "policy": ["full"] * 2 + ["h2o"] * 2, "budget": 8,
                       "nll": [10.0, 12.0, 11.0, 13.0], "tokens": [10] * 4, "peak_bytes": [4.0, 4, 2, 2],
                       "seconds": [1.0] * 4})
    s = summarize(df, n_resamples=100).set_index("policy")
    assert np.isclose(s.loc["h2o", "ppl"], np.exp(24 / 20)) and np.isnan(s.loc["h2o", ["ppl_low", "ppl_high"]]).all()
    assert np.isnan(s.loc["h2o", ["delta_low", "delta_high"]].astype(float)).all()
    p = pairwise(df, n_resamples=100)
    assert p[["delta_low", "delta_high"]].isna().all().all() and p.delta_ppl.notna().all()
