"""Compression once after the prefill (attngeom.kvcache.prefill), its baselines and geometry
policies (attngeom.kvcache.policies) on hand-computed cases and against direct computations, and
the long-context task experiment (attngeom.kvcache.tasks)."""

import numpy as np
import pandas as pd
import pytest
import torch

from attngeom.errors import InputError
from attngeom.kvcache import prefill as P
from attngeom.kvcache import tasks
from attngeom.kvcache.cache import kept_entries
from attngeom.kvcache.policies import (POLICIES, EvictionContext, adakv_budgets, get_policy,
                                       pyramid_budgets)
from attngeom.kvcache.ruler import Example, encode_example
from attngeom.kvcache.settings import TASK_POLICIES, KVTaskSettings
from tiny_models import eager_attentions, tiny_model

COMPRESSING = [n for n in POLICIES if n not in ("full", "taxonomy")]


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 128, (n,), generator=g).tolist()


def _ctx(score, budget, keys=None, n_kv=1):
    score = torch.as_tensor(score, dtype=torch.float32).reshape(1, n_kv, -1)
    n = score.shape[-1]
    pos = torch.arange(n).expand(1, n_kv, n)
    return EvictionContext(pos=pos, valid=torch.ones_like(pos, dtype=torch.bool), score=score,
                           values=torch.ones(1, n_kv, n, 2), seen=n, budget=torch.full((n_kv,), budget),
                           keys=keys, layer=0, num_heads=n_kv)


def _kept(policy, ctx, keep):
    idx, ok = kept_entries(get_policy(policy) if isinstance(policy, str) else policy, ctx,
                           torch.as_tensor(keep).reshape(-1).expand(ctx.pos.shape[1]))
    return [sorted(int(p) for p, o in zip(idx[0, h], ok[0, h]) if o) for h in range(idx.shape[1])]


# ---------------------------------------------------------------------------------------------
# the protocol: ratio 0 is the full cache; memory is freed
# ---------------------------------------------------------------------------------------------


def test_kept_count_is_kvpress_rule():
    assert [P.kept_count(100, r) for r in (0, 0.25, 0.5, 0.75, 0.875)] == [100, 75, 50, 25, 13]
    with pytest.raises(ValueError):
        P.kept_count(10, 1.0)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])          # GQA; hybrid (sliding layers kept as they are)
@pytest.mark.parametrize("mode", P.MODES)
def test_ratio_zero_answers_equal_generate_with_the_full_cache(arch, mode):
    h = tiny_model(arch)
    ctx, q = _ids(40), _ids(6, seed=1)
    want = h.model.generate(torch.tensor([ctx + q]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    want = want[0, len(ctx) + len(q):].tolist()
    names = ["random", "snapkv", "contribution", "kvzip", "adakv", "pyramidkv", "criticalkv", "loo_head"]
    pre = P.prefill(h, ctx + q if mode == P.QUERY_AWARE else ctx, [get_policy(n) for n in names])
    sels = [P.selection_at_ratio(pre, n, 0.0, h.num_heads) for n in names]
    cache = P.variant_cache(h, pre, sels, room=20)
    got = P.greedy_answers(h, cache, None if mode == P.QUERY_AWARE else q, pre.logits, 10)
    from attngeom.generation.decoding import model_stop_ids

    stops = model_stop_ids(h)
    want = want[: next((i for i, t in enumerate(want) if t in stops), len(want))]
    assert all(g == want for g in got), (got, want)


def test_compressed_generate_at_ratio_zero_is_generate():
    from attngeom.kvcache.generate import compressed_generate

    h = tiny_model("llama")
    ctx, q = _ids(30), _ids(5, seed=2)
    want = h.model.generate(torch.tensor([ctx + q]), max_new_tokens=8, do_sample=False)
    got = compressed_generate(h, ctx, q, "snap_contribution", 0.0, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    half = compressed_generate(h, ctx, q, "snap_contribution", 0.5, max_new_tokens=8, do_sample=False)
    assert half.shape[1] <= want.shape[1] and torch.equal(half[0, :35], want[0, :35])
    for bad in (1.0, -0.1):                                          # a share of the cache removed
        with pytest.raises(InputError, match="in \\[0, 1\\)"):
            compressed_generate(h, ctx, q, "snap_contribution", bad, max_new_tokens=8)


def test_every_policy_keeps_the_budget_and_the_memory_is_freed():
    h = tiny_model("llama")
    ctx = _ids(64)
    pols = [get_policy(n) for n in COMPRESSING]
    pre = P.prefill(h, ctx, pols)
    full = P.row_bytes(h, P.variant_cache(h, pre, [P.selection_at_ratio(pre, "window", 0.0, h.num_heads)]))
    for ratio in (0.5, 0.875):
        k = P.kept_count(64, ratio)
        total = k * h.num_kv_heads * h.num_layers
        sels = [P.selection_at_ratio(pre, p, ratio, h.num_heads) for p in pols]
        for p, s in zip(pols, sels):
            assert s.kept() == total, p.name                   # AdaKV and PyramidKV move budgets, not the total
            for l, idx in s.idx.items():
                for g in range(idx.shape[1]):
                    kept = idx[0, g][s.ok[l][0, g]]
                    assert kept.unique().numel() == kept.numel()   # no entry twice in a head
        uniform = [s for p, s in zip(pols, sels) if p.allocator is None]
        cache = P.variant_cache(h, pre, uniform)
        assert P.row_bytes(h, cache) == pytest.approx(full * k / 64)   # storages of the kept size, not masks


def test_finished_rows_leave_the_batch_without_changing_the_others():
    h = tiny_model("llama")
    ctx, q = _ids(40), _ids(4, seed=3)
    names = ["h2o", "window", "random", "knorm"]
    pre = P.prefill(h, ctx, [get_policy(n) for n in names])
    sels = [P.selection_at_ratio(pre, n, 0.5, h.num_heads) for n in names]
    alone = [P.greedy_answers(h, P.variant_cache(h, pre, [s]), q, None, 12) for s in sels]
    together = P.greedy_answers(h, P.variant_cache(h, pre, sels, room=16), q, None, 12)
    # make rows stop at different steps: the first token each row produces becomes a stop token
    h2 = tiny_model("llama")
    h2.model.generation_config.eos_token_id = [alone[0][0][2]]          # the first row stops at its third token
    alone2 = [P.greedy_answers(h2, P.variant_cache(h2, pre, [s]), q, None, 12) for s in sels]
    together2 = P.greedy_answers(h2, P.variant_cache(h2, pre, sels, room=16), q, None, 12)
    assert together == [a[0] for a in alone]
    assert together2 == [a[0] for a in alone2] and len({len(a) for a in together2}) > 1


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])          # GQA; hybrid (sliding layers kept as they are)
@pytest.mark.parametrize("mode", P.MODES)
def test_caches_read_as_one_batch_answer_as_each_alone(arch, mode):
    h = tiny_model(arch)
    ctx, q = _ids(40), _ids(4, seed=3)
    names = ["adakv", "pyramidkv", "h2o", "random"]                   # padded heads (AdaKV, PyramidKV) and not
    pre = P.prefill(h, ctx + q if mode == P.QUERY_AWARE else ctx, [get_policy(n) for n in names])
    question = None if mode == P.QUERY_AWARE else q

    def caches():                                                    # the full cache, then one cache per ratio (a row per policy)
        return [P.variant_cache(h, pre, [P.selection_at_ratio(pre, n, r, h.num_heads) for n in (names if r else ["full"])], room=16)
                for r in (0.0, 0.25, 0.75)]

    def alone():
        return [a for c in caches() for a in P.greedy_answers(h, c, question, pre.logits, 12)]

    h.model.generation_config.eos_token_id = [alone()[0][2]]          # the full cache's row (a cache of its own) stops first
    want = alone()
    assert P.greedy_answers(h, caches(), question, pre.logits, 12) == want
    assert len(want[0]) == 2 and max(len(a) for a in want) > 2       # its cache left the batch, the others went on


@pytest.mark.parametrize("n_q", [5, 1])                              # the question; one step of the answer
def test_masked_attention_equals_transformers_sdpa(n_q):
    # queries over a padded cache: several go through SDPA sharing each key/value head itself, bit for
    # bit what transformers' SDPA path gives after copying the keys and values per query head; one
    # (a decoding step) goes through transformers' path itself, which regroups the query heads
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from attngeom.kvcache import cache as C

    g = torch.Generator().manual_seed(0)
    B, Hkv, r, K, d = 3, 2, 3, 20, 8
    layer = P.PrefilledLayer(torch.randn(B, Hkv, K + n_q, d, generator=g), torch.randn(B, Hkv, K + n_q, d, generator=g),
                             torch.arange(K).expand(B, Hkv, K), torch.rand(B, Hkv, K, generator=g) > 0.3, K, Hkv * r,
                             room=n_q)
    k, v = layer.update(torch.randn(B, Hkv, n_q, d, generator=g), torch.randn(B, Hkv, n_q, d, generator=g))
    q = torch.randn(B, Hkv * r, n_q, d, generator=g)
    module = SimpleNamespace(num_key_value_groups=r, is_causal=True, training=False)
    got = C._attention(layer, module, q, k, v, None, scaling=0.3)[0]
    assert torch.equal(got, sdpa_attention_forward(module, q, k, v, layer.attention_mask(r), scaling=0.3)[0])


def _grid_caches(monkeypatch, h, ex, s):
    """answer_example's rows, and the caches it decoded (one list per call of greedy_answers)."""
    seen, real = [], P.greedy_answers

    def spy(handle, caches, *args, **kwargs):
        seen.append(list(caches))
        return real(handle, caches, *args, **kwargs)

    monkeypatch.setattr(P, "greedy_answers", spy)
    return tasks.answer_example(h, ex, s), seen


def test_the_grid_gives_each_variant_a_cache_of_its_own(monkeypatch):
    # one cache of one row per (policy, ratio) and the full cache, so a finished row's cache leaves
    # the batch and the other rows' storages stay where they are (nothing gathered again)
    from attngeom.kvcache.cache import stacked

    h = tiny_model("llama")
    s = KVTaskSettings(policies=("h2o", "window", "adakv"), ratios=(0.25, 0.75), n_resamples=50)
    _, seen = _grid_caches(monkeypatch, h, _examples(h, 1)[0], s)
    caches = seen[0]
    assert len(seen) == 1 and len(caches) == 1 + 3 * 2
    assert all(lay.keys.shape[0] == 1 for c in caches for lay in c.layers)
    heads = [max(lay.pos.shape[-1] for lay in c.layers) for c in caches[1:]]
    assert heads[0] == heads[1] < heads[2]                           # h2o and window: no AdaKV padding
    ptrs = [c.layers[0].keys.untyped_storage().data_ptr() for c in caches]
    cache = stacked(caches)
    for lay in cache.layers:
        lay.batch_select_indices(torch.tensor([0, 2, 5]))
    assert cache.layers[0].rows == [1, 1, 1]
    assert [p.keys.untyped_storage().data_ptr() for p in cache.layers[0].parts] == [ptrs[0], ptrs[2], ptrs[5]]


def _limited_to_one_ratio(monkeypatch):
    """A tiny model, an example and a grid of 3 ratios, answer_example's rows and decoded caches
    (:func:`_grid_caches`) without a memory limit, and then a memory limit with room for about one
    ratio's caches at a time."""
    h = tiny_model("llama")
    ex = _examples(h, 1)[0]
    s = KVTaskSettings(policies=("h2o", "adakv"), ratios=(0.25, 0.5, 0.875), n_resamples=50)
    whole, seen = _grid_caches(monkeypatch, h, ex, s)
    one_ratio = int(whole.loc[whole["ratio"] == 0.25, "bytes"].sum())
    monkeypatch.setattr(tasks, "memory_limit", lambda device=None: one_ratio + 1)
    return h, ex, s, whole, seen


def test_a_grid_over_the_memory_limit_is_decoded_in_several_batches(monkeypatch):
    h, ex, s, whole, seen = _limited_to_one_ratio(monkeypatch)
    assert len(seen) == 1
    split, seen = _grid_caches(monkeypatch, h, ex, s)
    assert len(seen) > 1 and sum(len(c) for c in seen) == 1 + 2 * 3
    cols = ["policy", "ratio", "answer", "score", "kept", "bytes", "answer_tokens"]
    assert split[cols].equals(whole[cols])


def test_a_batch_decoded_early_is_timed_once(monkeypatch):
    # a ratio that makes the batch held so far decode first does not count that decoding as its own:
    # on a clock that moves only while greedy_answers runs (100 s a call), the rows' seconds sum to
    # 100 s a batch, however many batches the memory limit makes
    import time

    clock, real = [0.0], P.greedy_answers
    h, ex, s, _, _ = _limited_to_one_ratio(monkeypatch)

    def slow(*args, **kwargs):
        out = real(*args, **kwargs)
        clock[0] += 100.0
        return out

    monkeypatch.setattr(P, "greedy_answers", slow)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    df, seen = _grid_caches(monkeypatch, h, ex, s)
    assert len(seen) > 1
    assert df["seconds"].sum() == pytest.approx(100.0 * len(seen))


def test_the_memory_limit_counts_the_page_cache_and_shares_it_between_local_processes(monkeypatch, tmp_path):
    from attngeom.kvcache import cache as C

    info = tmp_path / "meminfo"                  # a machine whose free memory sits mostly in its page cache
    info.write_text("MemTotal:       25000000 kB\nMemFree:         1000000 kB\nMemAvailable:   12000000 kB\n")
    monkeypatch.setattr(C, "MEMINFO", str(info))
    assert C.available_memory() == 12000000 * 1024
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert C.memory_limit() == 12000000 * 1024 // 2
    assert C.memory_limit("cpu") == C.memory_limit()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")              # torchrun's two processes on this machine
    assert C.memory_limit() == 12000000 * 1024 // 4
    monkeypatch.setattr(C, "MEMINFO", str(tmp_path / "absent"))  # no /proc: the free pages sysconf reports
    assert C.available_memory() > 0


def test_each_variant_holds_the_bytes_of_its_own_cache():
    # a uniform policy's bytes do not grow with a head-wise policy's largest head at the same ratio
    h = tiny_model("llama")
    ex = _examples(h, 1)[0]
    s = KVTaskSettings(policies=("h2o", "adakv"), ratios=(0.5,), n_resamples=50)
    a = tasks.answer_example(h, ex, s).set_index("policy")
    ctx, q, _ = encode_example(ex, h.tokenizer, s.chat)
    room = len(q) + ex.max_new_tokens
    assert a.loc["h2o", "bytes"] == tasks.cache_bytes_estimate(h, P.kept_count(len(ctx), 0.5) + room, 1)
    assert a.loc["full", "bytes"] == tasks.cache_bytes_estimate(h, len(ctx) + room, 1)
    assert a.loc["adakv", "bytes"] >= a.loc["h2o", "bytes"]


def test_gathered_entries_go_straight_into_the_storage_the_layer_keeps():
    # _gathered copies each row's kept entries in order, with room after them; the layer keeps that
    # storage (no second copy) and appends the next tokens in its room
    g = torch.Generator().manual_seed(1)
    Hkv, n, d, room = 2, 7, 3, 2
    t = torch.randn(1, Hkv, n, d, generator=g)
    idx = torch.tensor([[[0, 2, 5], [1, 3, 6]], [[4, 5, 6], [0, 1, 2]]])          # [R=2, Hkv, K=3]
    got = P._gathered(t, idx, room)
    assert got.shape == (2, Hkv, 3 + room, d)
    for r in range(2):
        for h in range(Hkv):
            assert torch.equal(got[r, h, :3], t[0, h, idx[r, h]])
    layer = P.PrefilledLayer(got, P._gathered(t, idx, room), idx, None, n, Hkv, room=room)
    assert layer.keys.data_ptr() == got.data_ptr() and torch.equal(layer.keys, got[:, :, :3])
    new = torch.randn(2, Hkv, 1, d, generator=g)
    k, _ = layer.update(new, new)
    assert k.data_ptr() == got.data_ptr() and torch.equal(k[:, :, 3:], new) and k.shape[2] == 4
    assert layer.pos[:, :, 3].eq(n).all()
    with pytest.raises(ValueError, match="storages of 3 \\+ 2 entries"):
        P.PrefilledLayer(t.expand(2, Hkv, n, d), t.expand(2, Hkv, n, d), idx, None, n, Hkv, room=room)
    with pytest.raises(ValueError, match="storages of their own"):                # appended into both in place
        P.PrefilledLayer(got, got, idx, None, n, Hkv, room=room)
    # nothing kept, room for the question: placeholders only, then the appended tokens
    none = P._gathered(t, idx[..., :0], room)
    assert none.shape == (2, Hkv, room, d) and torch.equal(none[:, 1, 0], t[0, 1, 0].expand(2, d))
    empty = P.PrefilledLayer(none, P._gathered(t, idx[..., :0], room), idx[..., :0], None, n, Hkv, room=room)
    k, _ = empty.update(new, new.clone())
    assert k.shape[2] == 1 and torch.equal(k, new)


# ---------------------------------------------------------------------------------------------
# baselines on hand-computed cases
# ---------------------------------------------------------------------------------------------


def test_knorm_keeps_the_smallest_keys():
    keys = torch.tensor([3.0, 1.0, 0.5, 2.0, 0.1, 4.0]).reshape(1, 1, 6, 1) * torch.tensor([0.6, 0.8])
    assert _kept("knorm", _ctx([0] * 6, 3, keys=keys), 3) == [[1, 2, 4]]


def test_random_is_seeded_per_layer():
    ctx = _ctx([0] * 50, 10)
    a, b = _kept("random", ctx, 10), _kept("random", ctx, 10)
    ctx.layer = 1
    assert a == b and _kept("random", ctx, 10) != a


def test_pyramid_budgets_are_kvpress_with_its_fallback_to_uniform():
    cs = {l: _ctx([0] * 1000, 0) for l in range(5)}
    # k = 500, beta 20: from 2k - k/20 = 975 down to k/20 = 25 (kvpress's get_layer_budget), mean 500
    b = pyramid_budgets(cs, 0.5, beta=20, window=8)
    assert [int(b[l][0]) for l in range(5)] == [975, 738, 500, 262, 25]     # round(975 - m * 237.5), half to even
    # k = 125, k/beta = 6.25 < window 32: every layer keeps round(k) (uniform SnapKV, kvpress's fallback)
    b = pyramid_budgets(cs, 0.875, beta=20, window=32)
    assert [int(b[l][0]) for l in range(5)] == [125] * 5
    # k = 750: the first layer would keep 1462.5 > n - w = 992, so 992 down to 2k - 992 = 508
    b = pyramid_budgets(cs, 0.25, beta=20, window=8)
    assert [int(b[l][0]) for l in range(5)] == [992, 871, 750, 629, 508]


def test_adakv_shares_the_layer_budget_across_heads_with_a_floor():
    # head 0's scores dwarf head 1's: head 0 takes every free place, head 1 keeps its floor
    score = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 0.5], [0.01] * 10]
    cs = {0: _ctx(score, 0, n_kv=2)}
    b = adakv_budgets(cs, 0.5, lambda ctx: (torch.zeros_like(ctx.pos), ctx.score), floor=0.2)
    assert b[0].tolist() == [9, 1]                         # 2 heads × 5 = 10; floor int(0.2·5) = 1
    b = adakv_budgets(cs, 0.5, lambda ctx: (torch.zeros_like(ctx.pos), ctx.score), floor=1.0)
    assert b[0].tolist() == [5, 5]


@pytest.mark.parametrize("name, inner", [("adakv", "snapkv"), ("adakv_contribution", "snap_contribution")])
def test_adakv_takes_its_inner_policys_scores_and_protections(name, inner):
    """AdaKV is given its inner policy itself (no registry look-up from policies/budgets.py): its
    scores, protections and needs are the inner policy's, its identity names it."""
    a, b = get_policy(name), get_policy(inner)
    assert a.params["inner"] == inner and a.name == name and a.allocator is not None
    assert (a.needs, a.accumulate, a.pool, a.last, a.signed, a.geometry) == \
        (b.needs, b.accumulate, b.pool, b.last, b.signed, b.geometry)
    cs = _ctx([[9, 8, 7, 6, 5, 4, 3, 2, 1, 0.5], [0.01] * 10], 0, n_kv=2)
    for x, y in zip(a.priority(cs), b.priority(cs)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["kvzip", "kvzip_plus"])
def test_kvzip_keeps_the_highest_pooled_scores_of_the_whole_model(name):
    """The global cut on a real prefill: the kept (layer, head, entry) triples are exactly the
    N - int(N * ratio) highest of every layer's scores pooled by the maximum over each group."""
    h = tiny_model("llama")
    ids = _ids(40)
    pre = P.prefill(h, ids, [get_policy(name)])
    r = h.num_heads // h.num_kv_heads
    pooled = {l: s[0].reshape(h.num_kv_heads, r, -1).amax(1) for l, s in pre.scores[name].items()}   # [Hkv, n]
    flat = torch.cat([pooled[l].reshape(-1) for l in sorted(pooled)])
    for ratio in (0.25, 0.75):
        keep = flat.numel() - int(flat.numel() * ratio)
        threshold = flat.sort(descending=True).values[keep - 1]
        assert (flat > threshold).sum() < keep <= (flat >= threshold).sum()
        sel = P.selection_at_ratio(pre, name, ratio, h.num_heads)
        assert sel.kept() == keep
        for l, idx in sel.idx.items():
            for g in range(h.num_kv_heads):
                kept = idx[0, g][sel.ok[l][0, g]]
                dropped = torch.ones(len(ids), dtype=torch.bool)
                dropped[kept] = False
                assert (pooled[l][g, kept] >= threshold).all() and (pooled[l][g, dropped] <= threshold).all()


def test_global_contribution_keeps_every_window_then_the_highest_of_all_layers():
    from attngeom.kvcache.policies import global_contribution

    pol = global_contribution(window=1, kernel=1)
    # 2 layers x 1 head x 4 entries, ratio 0.5: 4 kept; both windows (entry 3) first, then 5 and 4
    cs = {0: _ctx([5, 1, 0, 9], 0), 1: _ctx([4, 3, 2, 0.1], 0)}
    b = pol.allocate(cs, 0.5)
    assert b[0].tolist() == [2] and b[1].tolist() == [2]
    assert _kept(pol, cs[0], b[0]) == [[0, 3]] and _kept(pol, cs[1], b[1]) == [[0, 3]]
    cs = {0: _ctx([5, 1, 0, 9], 0), 1: _ctx([0.5, 3, 2, 0.1], 0)}                   # now 5 and 3
    b = pol.allocate(cs, 0.5)
    assert _kept(pol, cs[0], b[0]) == [[0, 3]] and _kept(pol, cs[1], b[1]) == [[1, 3]]
    cs = {0: _ctx([5, 4.5, 0, 9], 0), 1: _ctx([0.5, 3, 2, 0.1], 0)}                 # 5 and 4.5: layer 0 takes both
    b = pol.allocate(cs, 0.5)
    assert b[0].tolist() == [3] and b[1].tolist() == [1]


def test_criticalkv_first_stage_by_attention_then_by_projected_values():
    # 8 entries, window 0, budget 4: stage one keeps the 2 highest scores (entries 0, 1); the rest
    # goes by score x |W_O v|_1, which favours entries 6 and 7 (large values) over 2 and 3
    score = torch.tensor([8.0, 7, 6, 5, 1, 1, 1.5, 1.2])
    values = torch.ones(1, 1, 8, 2)
    values[0, 0, 6:] = 10.0
    ctx = _ctx(score, 4)
    ctx.values, ctx.w_o = values, torch.eye(2)
    from attngeom.kvcache.policies import criticalkv

    assert _kept(criticalkv(window=0, kernel=1), ctx, 4) == [[0, 1, 6, 7]]


def test_criticalkv_window_counts_in_the_first_stage_as_kvpress():
    from attngeom.kvcache.policies import criticalkv

    # 8 entries, window 2 (entries 6, 7), budget 6, first stage int(0.5 * 6) = 3: the window and
    # entry 0 (the highest score); the other 3 places by (s + eps) x |W_O v|_1, which favours 4 and 5
    score = torch.tensor([9.0, 8, 7, 6, 1, 1, 0, 0])
    values = torch.ones(1, 1, 8, 2)
    values[0, 0, 4:6] = 20.0
    ctx = _ctx(score, 6)
    ctx.values, ctx.w_o = values, torch.eye(2)
    assert _kept(criticalkv(window=2, kernel=1), ctx, 6) == [[0, 1, 4, 5, 6, 7]]


def test_suppressor_keeps_the_most_negative_contributions_first():
    from attngeom.kvcache.policies import suppressor

    score = [-5.0, 1, 2, 3, -0.1, 4, 0.5, 6]
    assert _kept(suppressor(window=0, kernel=1, count=2), _ctx(score, 4), 4) == [[0, 4, 5, 7]]


# ---------------------------------------------------------------------------------------------
# scores against direct computations on a tiny model
# ---------------------------------------------------------------------------------------------


def _eager_layer_pieces(h, ids):
    """Per layer: attention [H, T, T], per-head values [H, T, d] and W_O from an eager forward."""
    values = {}
    hooks = [(layer.self_attn.v_proj, lambda m, a, o, l=l: values.__setitem__(l, o))
             for l, layer in enumerate(h.model.model.layers)]
    att = eager_attentions(h, ids, hooks)
    cfg = h.model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    out = []
    for l in range(len(att)):
        v = values[l][0].reshape(len(ids), h.num_kv_heads, d).transpose(0, 1)        # [Hkv, T, d]
        v = v.repeat_interleave(h.num_heads // h.num_kv_heads, dim=0)                 # [H, T, d]
        w_o = h.model.model.layers[l].self_attn.o_proj.weight.detach()                 # [D, H*d]
        out.append((att[l][0].float(), v.float(), w_o))
    return out


@pytest.mark.parametrize("head_space", [False, True])
def test_leave_one_out_equals_dropping_the_source_and_renormalising(head_space):
    h = tiny_model("llama")
    ids = _ids(20)
    name = "loo_head" if head_space else "dropkv"
    pre = P.prefill(h, ids, [get_policy(name)])
    window = get_policy(name).last
    d = h.model.config.hidden_size // h.num_heads
    for l, (a, v, w_o) in enumerate(_eager_layer_pieces(h, ids)):
        want = torch.zeros(h.num_heads, len(ids))
        for hd in range(h.num_heads):
            W = w_o[:, hd * d:(hd + 1) * d]
            for i in range(max(0, len(ids) - window), len(ids)):
                o = a[hd, i] @ v[hd]
                for j in range(i + 1):
                    keep = a[hd, i].clone()
                    keep[j] = 0
                    # drop j, renormalise (nothing left: the output is gone)
                    o_drop = (keep / keep.sum()) @ v[hd] if keep.sum() > 0 else torch.zeros_like(o)
                    diff = o_drop - o
                    want[hd, j] += ((W @ diff).norm() if head_space else diff.norm()) ** 2    # squared (DropKV)
        got = pre.scores[name][l][0]
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (l, (got - want).abs().max(), ((got - want).abs() / want.abs().clamp_min(1e-9)).max(), (got - want).abs().argmax())


@pytest.mark.parametrize("name", ["snap_contribution", "suppressor"])
def test_window_contribution_scores_are_the_last_queries_contributions_summed(name):
    """snap_contribution sums |c_ij^h| over the last ``window`` queries, suppressor the signed
    c_ij^h: against the contributions of a full trace (SPEC §2), summed directly."""
    from attngeom import analyze

    h = tiny_model("llama")
    ids = _ids(80)
    policy = get_policy(name)
    assert policy.last < len(ids)                        # the window is a proper part of the context
    pre = P.prefill(h, ids, [policy])
    trace = analyze(h, torch.tensor(ids))
    for l in range(len(trace.layers)):
        c = torch.as_tensor(np.asarray(trace.layers[l].contribution)).float()[:, -policy.last:]  # [H, window, T]
        want = (c if policy.signed else c.abs()).sum(1)
        assert torch.allclose(pre.scores[name][l][0], want, atol=1e-5), (name, l)


@pytest.mark.parametrize("name", ["kvzip", "kvzip_plus", "kvzip_contribution"])
def test_kvzip_scores_are_kvpress_reconstruction_chunk_by_chunk(name, monkeypatch):
    """KVzip as kvpress's KVzipPress scores it, recomputed from an eager forward of the context and
    each chunk's request: the chat prefix found, chunks of KVZIP_CHUNK tokens (3 here), each
    request = prompt (+ the last 8 tokens of the chunk before) + the template's turn suffix + the
    chunk; the attention renormalised over the 4 sinks, the chunk and the request; the maximum over
    the request's queries (KVzip+: times |W_O^h v_j| / |h_i|; kvzip_contribution: |c_ij| of the
    renormalised output); the sinks 1, the prefix's other entries 0."""
    from attngeom.kvcache import policies as POL
    from tiny_models import tiny_chat_tokenizer

    monkeypatch.setattr(POL, "KVZIP_CHUNK", 12)
    h = tiny_model("llama")
    tok = tiny_chat_tokenizer()
    h.tokenizer = tok
    prefix = tok.encode("<s>user: ", add_special_tokens=False)
    ids = prefix + _ids(30)
    n = len(ids)
    pre = P.prefill(h, ids, [get_policy(name)])
    enc = lambda t: tok.encode(t, add_special_tokens=False)                      # noqa: E731
    suffix = enc("</s>\n<s>assistant:")
    cfg = h.model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    want = torch.zeros(h.num_layers, h.num_heads, n)
    want[..., :4] = 1.0
    for start in range(len(prefix), n, 12):
        end = min(start + 12, n)
        ask = enc("\n\nRepeat the previous context exactly.") if start == len(prefix) else \
            enc("\n\nRepeat the part of the previous context exactly, starting with") + ids[start - 8:start]
        whole = ids + ask + suffix + ids[start:end]
        values, normed = {}, {}
        hooks = [(layer.self_attn.v_proj, lambda m, a, o, l=l: values.__setitem__(l, o))
                 for l, layer in enumerate(h.model.model.layers)]
        hooks += [(layer.input_layernorm, lambda m, a, o, l=l: normed.__setitem__(l, o))
                  for l, layer in enumerate(h.model.model.layers)]
        att = eager_attentions(h, whole, hooks)
        inside = torch.zeros(len(whole), dtype=torch.bool)
        inside[:4] = True
        inside[start:end] = True
        inside[n:] = True
        for l in range(h.num_layers):
            a = att[l][0, :, n:].float() * inside                                   # [H, Q, T]
            a = a / a.sum(-1, keepdim=True)
            v = values[l][0].reshape(len(whole), h.num_kv_heads, d).transpose(0, 1)
            v = v.repeat_interleave(h.num_heads // h.num_kv_heads, dim=0).float()   # [H, T, d]
            w_o = h.model.model.layers[l].self_attn.o_proj.weight.detach().float()
            wv = torch.stack([v[hd] @ w_o[:, hd * d:(hd + 1) * d].T for hd in range(h.num_heads)])  # [H, T, D]
            if name == "kvzip":
                m = a
            elif name == "kvzip_plus":
                m = a * wv.norm(dim=-1)[:, None, :] / normed[l][0, n:].float().norm(dim=-1)[None, :, None]
            else:
                o = a @ wv                                                         # [H, Q, D]
                m = (a * (wv @ o.transpose(1, 2)).transpose(1, 2)).abs() / (o * o).sum(-1, keepdim=True)
            want[l, :, start:end] = m[..., start:end].amax(1)
    for l in range(h.num_layers):
        assert torch.allclose(pre.scores[name][l][0], want[l], rtol=1e-4, atol=1e-6), (name, l)


def test_kvzip_reads_only_the_sinks_the_chunk_and_its_own_tokens_of_a_block():
    # n = 20 context entries, 4 sinks, chunk [8, 12); a block whose sources start at 6 holds
    # columns 0.. for positions 6..: no sink, the chunk at columns 2..5, its own tokens from column 14
    r = P.ReconstructionScores(20, 8, 12, 4, ["attention"])
    assert r._inside(6, 18) == [(2, 6), (14, 18)]
    assert r._inside(0, 24) == [(0, 4), (8, 12), (20, 24)]
    assert r._inside(0, 10) == [(0, 4), (8, 10)]             # a block that ends inside the chunk


def test_kvzip_without_a_chat_prefix_repeats_from_the_first_token():
    from attngeom.kvcache.policies import KVZIP_PROMPT

    h = tiny_model("llama")
    ids = _ids(16)
    pre = P.prefill(h, ids, [get_policy("kvzip")])
    whole = ids + h.tokenizer.encode(KVZIP_PROMPT + "\n", add_special_tokens=False) + ids
    att = eager_attentions(h, whole)
    for l in range(h.num_layers):
        want = att[l][0, :, len(ids):, :len(ids)].float().amax(1)                     # [H, n]: sinks scored too
        assert torch.allclose(pre.scores["kvzip"][l][0], want, atol=1e-5), l


def test_global_cut_keeps_the_highest_scores_of_all_layers_and_heads():
    from attngeom.kvcache.policies import global_budgets

    # 2 layers x 2 heads x 4 entries; ratio 0.5 keeps the 8 highest of 16: 9 8 7 6 5 4 3.5 3
    cs = {0: _ctx([[9, 8, 1, 0], [7, 0.5, 0.2, 0.1]], 0, n_kv=2), 1: _ctx([[6, 5, 4, 3.5], [3, 2, 1.5, 0]], 0, n_kv=2)}
    b = global_budgets(cs, 0.5, lambda ctx: (torch.zeros_like(ctx.pos), ctx.score))
    assert b[0].tolist() == [2, 1] and b[1].tolist() == [4, 1]
    # 16 - int(16 * 0.3) = 12 kept
    b = global_budgets(cs, 0.3, lambda ctx: (torch.zeros_like(ctx.pos), ctx.score))
    assert b[0].tolist() == [3, 2] and b[1].tolist() == [4, 3]
    assert _kept("kvzip", cs[0], b[0]) == [[0, 1, 2], [0, 1]]


def test_criticalkv_value_term_is_the_projected_value_l1_norm():
    from attngeom.kvcache.policies import projected_value_l1

    h = tiny_model("llama")
    ids = _ids(12)
    pre = P.prefill(h, ids, [get_policy("criticalkv")])
    d = h.model.config.hidden_size // h.num_heads
    for l, (_, v, w_o) in enumerate(_eager_layer_pieces(h, ids)):
        ctx = P.eviction_context(pre, get_policy("criticalkv"), l, h.num_heads)
        r = h.num_heads // h.num_kv_heads
        want = torch.stack([torch.stack([(w_o[:, hd * d:(hd + 1) * d] @ v[hd].T).abs().sum(0)
                                         for hd in range(g * r, (g + 1) * r)]).mean(0) for g in range(h.num_kv_heads)])
        assert torch.allclose(projected_value_l1(ctx)[0], want, rtol=1e-4, atol=1e-5), l


# ---------------------------------------------------------------------------------------------
# the experiment
# ---------------------------------------------------------------------------------------------


def _examples(h, n=2):
    return [Example(task="toy", index=i, seed=0, context="the key is abc. " * 3, question="\nWhat is the key?",
                    answer_prefix=" The key is", answers=("abc",), max_new_tokens=4, length=76) for i in range(n)]


def test_experiment_tables_and_too_few_examples():
    h = tiny_model("llama")
    s = KVTaskSettings(policies=("h2o", "snap_contribution"), ratios=(0.5,), n_resamples=50)
    res = tasks.experiment(h, None, _examples(h), s)
    a = res.tables["answers"]
    assert len(a) == 2 * 3 and set(a["policy"]) == {"full", "h2o", "snap_contribution"}
    assert (a.loc[a["policy"] == "full", "kept_share"] == 1).all()
    assert a.loc[a["policy"] != "full", "kept_share"].between(0.45, 0.55).all()
    assert a["score"].between(0, 1).all()
    summ = res.tables["summary"]
    assert summ["low"].isna().all() and summ["examples"].eq(2).all()          # 2 examples: no interval
    assert all(v["verdict"] == "too few examples" for v in res.summary["verdicts"])
    pairs = res.tables["pairs"]
    assert set(pairs["baseline"]) == {"h2o"} and pairs.loc[pairs["policy"] == "h2o", "delta"].eq(0).all()


def test_summaries_on_hand_scores():
    rows = []
    for ex in range(12):
        rows += [{"task": "t", "example": ex, "policy": "full", "ratio": 0.0, "score": 1.0},
                 {"task": "t", "example": ex, "policy": "h2o", "ratio": 0.5, "score": float(ex % 2)},
                 {"task": "t", "example": ex, "policy": "knorm", "ratio": 0.5, "score": 0.0},
                 {"task": "t", "example": ex, "policy": "contribution", "ratio": 0.5, "score": 1.0}]
    df = pd.DataFrame(rows).assign(kept_share=1.0, bytes=1.0, seconds=1.0)
    summ = tasks.summarize(df, n_resamples=200).set_index(["policy", "ratio"])
    assert summ.loc[("h2o", 0.5), "accuracy"] == 0.5 and summ.loc[("contribution", 0.5), "accuracy"] == 1.0
    assert summ.loc[("h2o", 0.5), "low"] < 0.5 < summ.loc[("h2o", 0.5), "high"]
    assert tasks.best_baselines(tasks.summarize(df, 1)) == {0.5: "h2o"}
    pairs = tasks.paired(df, n_resamples=200).set_index("policy")
    assert pairs.loc["contribution", "delta"] == 0.5 and pairs.loc["contribution", "low"] > 0
    v = tasks.verdicts(tasks.paired(df, n_resamples=200))
    assert [x["verdict"] for x in v] == ["beats"] and v[0]["policy"] == "contribution"
    # a policy of one's own that this process has not loaded: known by the kind its run recorded
    mine = df.replace({"policy": {"contribution": "mine"}})
    with pytest.raises(InputError, match="neither attngeom's nor recorded"):
        tasks.paired(mine, n_resamples=10)
    kinds = {"mine": True}
    assert tasks.best_baselines(tasks.summarize(mine, 1), kinds) == {0.5: "h2o"}
    pairs = tasks.paired(mine, n_resamples=10, geometry=kinds).set_index("policy")
    assert bool(pairs.loc["mine", "geometry"]) and not pairs.loc["h2o", "geometry"]


def test_over_all_tasks_each_task_weighs_the_same():
    """A sample gathered in parts holds more examples of some tasks: over all tasks the accuracy and
    the paired difference are means over tasks, not over examples (RULER's average). Task ``a``
    (10 examples, contribution always right, H2O never) and task ``b`` (30 examples, both never
    right): 0.5 over all tasks, not 0.25; with as many examples per task the two means agree."""
    rows = []
    for task, n, right in (("a", 10, 1.0), ("b", 30, 0.0)):
        for ex in range(n):
            rows += [{"task": task, "example": ex, "policy": "full", "ratio": 0.0, "score": 1.0},
                     {"task": task, "example": ex, "policy": "h2o", "ratio": 0.5, "score": 0.0},
                     {"task": task, "example": ex, "policy": "contribution", "ratio": 0.5, "score": right}]
    df = pd.DataFrame(rows).assign(kept_share=1.0, bytes=1.0, seconds=1.0)
    summ = tasks.summarize(df, n_resamples=200).set_index(["task", "policy", "ratio"])
    every = summ.loc[(tasks.ALL_TASKS, "contribution", 0.5)]
    assert every["accuracy"] == pytest.approx(0.5) and every["examples"] == 40
    assert every["low"] < 0.5 < every["high"]
    assert summ.loc[("a", "contribution", 0.5), "accuracy"] == 1.0
    pairs = tasks.paired(df, n_resamples=200).set_index(["task", "policy"])
    assert pairs.loc[(tasks.ALL_TASKS, "contribution"), "delta"] == pytest.approx(0.5)
    even = df[df["example"] < 10]                                       # 10 and 10: the plain mean
    s2 = tasks.summarize(even, n_resamples=1).set_index(["task", "policy", "ratio"])
    assert s2.loc[(tasks.ALL_TASKS, "contribution", 0.5), "accuracy"] == 0.5


def test_bad_grids_are_refused_in_one_line():
    from attngeom.errors import InputError

    with pytest.raises(InputError, match="ratio-0 reference"):
        tasks.check_policies(["full"])
    with pytest.raises(InputError, match="taxonomy"):
        tasks.check_policies(["taxonomy"])
    with pytest.raises(InputError, match=r"\(0, 1\)"):
        tasks.check_ratios([0.5, 1.0])
    h = tiny_model("llama")
    with pytest.raises(InputError, match="GiB"):
        tasks.check_memory(h, 10_000, 18, limit=1000)
    assert set(TASK_POLICIES) <= set(POLICIES)
