"""The fused routes (SPEC §10, :mod:`attngeom.capture.routes`) against the definitions.

Every quantity of :class:`~attngeom.capture.routes.FusedLayer` (one column, the diagonal, the
entropy from ``lse``, head outputs and shares, what each source receives through the attention's
backward ``PᵀF``, the source winner) is compared in float64 with a dense computation from the
attention map and :mod:`attngeom.metrics.formulas` (the block path's formulas): on random inputs with
grouped queries, padding, sliding windows, learned sinks and a value width other than the key's, and
on the q, k, v of tiny models of every family; then the summaries of the fused route against the
block path's, end to end."""

import pytest
import torch

from attngeom.capture import routes
from attngeom.errors import InputError
from attngeom.metrics import formulas as F

TOL = dict(rtol=1e-10, atol=1e-10)
NAMES = routes.FUSED_RECEIVED


def _dense(q, k, v, scale, mask, sinks, G, G_full):
    """The attention map and every statistic from it, as the block path defines them (float64;
    hidden sources get the dtype's minimum, as in eager attention and the block path)."""
    B, H, T, _ = q.shape
    n_rep = H // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    seen = torch.ones(T, T, dtype=torch.bool).tril()[None, None] if mask is None else mask
    s = s.masked_fill(~seen, torch.finfo(s.dtype).min)    # eager's: a row that sees nothing is uniform
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    full = torch.softmax(s, dim=-1)
    a = full[..., :T]
    sink = None if sinks is None else full[..., T]
    u = a @ v
    uG, p = u @ G, F.pulled_back(u, G_full)
    hsq, osq = F.quad(u, G), F.output_sq_norm(u, p)
    ent = -torch.special.xlogy(full, full).sum(-1)
    return dict(a=a, v=v, k=k, sink=sink, u=u, uG=uG, p=p, hsq=hsq, osq=osq, entropy=ent,
                value_norm=F.projected_value_norm(v, G),
                contribution=F.contribution_from(a, uG, v, hsq),
                contribution_inter=F.contribution_inter_from(a, p, v, osq),
                head_share=F.head_share_from(u, p, osq))


def _random_case(seed, *, B=2, H=4, Hkv=2, T=13, dk=8, dv=8, lengths=None, window=None, sinks=False):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)   # noqa: E731
    q, k, v = rnd(B, H, T, dk), rnd(B, Hkv, T, dk), rnd(B, Hkv, T, dv)
    w_o = rnd(16, H * dv)
    lengths = torch.full((B,), T) if lengths is None else torch.tensor(lengths)
    mask = None
    if window is not None or (lengths < T).any():
        pos = torch.arange(T)
        m = pos[None, :] <= pos[:, None]
        if window is not None:
            m = m & (pos[None, :] > pos[:, None] - window)
        mask = (m[None] & (pos[None, None, :] < lengths[:, None, None]))[:, None]    # [B, 1, T, T]
    return dict(q=q, k=k, v=v, scale=0.37, mask=mask, lengths=lengths, window=window, G=F.gram(w_o, H), G_full=F.full_gram(w_o),
                sinks=rnd(H) if sinks else None)


def _check_layer(case, sink_col=0):
    q, k, v, mask, sinks = case["q"], case["k"], case["v"], case["mask"], case["sinks"]
    ref = _dense(q, k, v, case["scale"], mask, sinks, case["G"], case["G_full"])
    fused = routes.FusedLayer(q, k, v, case["scale"], mask, case["G"], case["G_full"], case["lengths"], sinks=sinks,
                              window=case["window"])
    masked = routes.FusedLayer(q, k, v, case["scale"], mask, case["G"], case["G_full"], case["lengths"], window=-1)
    valid = fused.query_valid[:, None, :].expand(ref["hsq"].shape)                  # [B, H, T]
    T = q.shape[2]

    def close(got, want, what):
        torch.testing.assert_close(got[valid], want[valid], **TOL, msg=what)

    close(fused.head_output.norm(dim=-1), ref["u"].norm(dim=-1), "head outputs")
    close(fused.attention_column(sink_col), ref["a"][..., sink_col], "sink column")
    close(fused.self_attention, torch.diagonal(ref["a"], dim1=-2, dim2=-1), "diagonal")
    close(fused.entropy, ref["entropy"], "entropy")
    close(fused.head_output_norm, ref["hsq"].sqrt(), "head output norms")
    close(fused.head_share, ref["head_share"], "head shares")
    close(fused.contribution_column(sink_col), ref["contribution"][..., sink_col], "sink contribution")
    close(fused.contribution_inter_column(sink_col), ref["contribution_inter"][..., sink_col], "inter")
    if sinks is not None:
        close(fused.learned_sink, ref["sink"], "learned sink")
    assert mask is None or routes.describes(mask, case["window"], case["lengths"])   # the winner's kernel serves all
    for norms in (ref["v"].norm(dim=-1), ref["value_norm"]):
        want = (ref["a"] * norms[:, :, None, :]).argmax(-1)
        assert torch.equal(fused.winner(norms)[valid], want[valid])              # the fused kernel's pass
        if mask is not None:
            assert torch.equal(masked.winner(norms)[valid], want[valid])         # any mask
    w = fused.query_valid.double()
    got = fused.received(w, NAMES, value_norm=ref["value_norm"])
    want = F.received(ref["a"], w, NAMES, v=ref["v"], value_norm=ref["value_norm"],
                      head_out_norm=ref["hsq"].sqrt(), p=ref["p"], out_sq=ref["osq"])
    for n in NAMES:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=n)
    seen = (ref["a"].new_ones(T, T).tril()[None] if mask is None else mask[:, 0].double())
    torch.testing.assert_close(fused.seen_by(w), (w[:, None, :] @ seen.expand(w.shape[0], T, T)).squeeze(1), **TOL)


CASES = {
    "causal, grouped queries": dict(),
    "multi-query": dict(Hkv=1),
    "padded batch": dict(lengths=[13, 8]),
    "sliding window": dict(window=4),
    "window and padding": dict(window=5, lengths=[9, 13]),
    "learned sinks": dict(sinks=True, window=6),
    "value width other than the key's (MLA)": dict(dk=12, dv=6),
    "wide values": dict(dk=4, dv=10, lengths=[11, 13]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_fused_quantity_equals_the_definition_in_float64(name):
    _check_layer(_random_case(len(name), **CASES[name]))


def test_a_route_that_cannot_reproduce_the_attention_says_why():
    q, k = torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4)
    assert routes.unsupported(q, k, None, None) is None
    assert "soft-capping" in routes.unsupported(q, k, None, 50.0)
    assert "cached" in routes.unsupported(q[:, :, :1], k, None, None)
    assert "additive" in routes.unsupported(q, k, torch.zeros(1, 1, 5, 5), None)
    with pytest.raises(InputError, match="auto, fused, block"):
        routes.check_route("fast")


def test_the_winner_takes_the_fused_kernel_exactly_when_the_mask_is_causal_with_window_and_padding():
    T, lengths = 9, torch.tensor([9, 6])
    pos = torch.arange(T)
    causal = pos[None, :] <= pos[:, None]
    window = causal & (pos[None, :] > pos[:, None] - 3)
    padded = lambda m: (m[None] & (pos[None, None, :] < lengths[:, None, None]))[:, None]   # noqa: E731
    assert routes.describes(padded(window), 3, lengths) and routes.describes(padded(causal), None, lengths)
    assert not routes.describes(padded(window), None, lengths) and not routes.describes(padded(window), 4, lengths)
    other = padded(causal).clone()
    other[1, 0, 4, 2] = False                    # one hidden source the three rules do not hide
    assert not routes.describes(other, None, lengths)


def test_the_masked_winner_breaks_ties_to_the_earliest_source():
    q = torch.zeros(1, 1, 4, 2, dtype=torch.float64)          # every logit 0: a row is uniform
    n = torch.tensor([[[1.0, 2.0, 2.0, 1.0]]], dtype=torch.float64)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    assert routes.source_winner_masked(q, q, n, scale=1.0, mask=mask).tolist() == [[[0, 1, 1, 1]]]
    mask[..., 3, 1:3] = False
    assert routes.source_winner_masked(q, q, n, scale=1.0, mask=mask).tolist() == [[[0, 1, 1, 0]]]

# --------------------------------------------------------------------------------------------
# The attention calls of tiny models of every family, recorded in float64
# --------------------------------------------------------------------------------------------

RECORDER = "attngeom_test_routes"


def _family(name):
    """A float32 tiny model of the family ``name``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiny_models import tiny_model

    small = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if name == "gpt_oss":       # learned sinks, sliding and full layers
        cfg = AutoConfig.for_model("gpt_oss", **small, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                   layer_types=["sliding_attention", "full_attention"])
    elif name == "deepseek_v3":  # multi-head latent attention: value width 24, query/key width 16
        cfg = AutoConfig.for_model("deepseek_v3", **{**small, "num_key_value_heads": 4, "head_dim": 8},
                                   kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                   v_head_dim=24, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
    else:
        return tiny_model(name).model
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _recorded_calls(model, lengths, T=20):
    """Every attention call of one forward of a right-padded batch: ``[(module, kwargs)]``, q, k, v
    and sinks in float64 (the calls go on to attngeom's function, outside any session: SDPA, or the
    exact blocked attention)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from attngeom.capture import Session    # noqa: F401 - registers attngeom's attention function
    from attngeom.model.adapter import adapter_for, attention_implementation

    adapter_for(model)          # discovery: the output projection of every attention module
    calls = []

    def record(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kw):
        up = lambda x: None if x is None else x.detach().double()      # noqa: E731
        calls.append((module, dict(q=up(query), k=up(key), v=up(value), mask=attention_mask, scaling=scaling,
                                   softcap=softcap, sinks=up(kw.get("s_aux")), window=kw.get("sliding_window"))))
        return ALL_ATTENTION_FUNCTIONS["attngeom"](module, query, key, value, attention_mask, dropout=dropout,
                                                   scaling=scaling, softcap=softcap, **kw)

    AttentionInterface.register(RECORDER, record)
    AttentionMaskInterface.register(RECORDER, sdpa_mask)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 128, (len(lengths), T), generator=g)
    ids[:, 0] = 1
    keep = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    with attention_implementation(model, RECORDER), torch.no_grad():
        model(input_ids=ids * keep, attention_mask=keep.long(), use_cache=False)
    return calls


FAMILIES = {   # family: (model, rows' lengths)
    "llama (GQA)": ("llama", [20]),
    "mistral (MQA, sliding window)": ("mistral", [20]),
    "gemma3 (sliding and full, q/k norms)": ("gemma3_text", [20]),
    "qwen3 (head size != hidden / heads)": ("qwen3", [20]),
    "gemma2 (soft-capping)": ("gemma2", [20]),
    "gpt-oss (learned sinks)": ("gpt_oss", [20]),
    "deepseek-v3 (MLA)": ("deepseek_v3", [20]),
    "padded batch": ("llama", [20, 13, 7]),
    "padded batch, sliding window": ("mistral", [20, 11]),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_fused_quantity_equals_the_definition_on_every_family(family):
    """float64: each layer's recorded q, k, v, mask, scaling and sinks (upcast), through the fused route and
    through the definitions; a layer the route cannot reproduce (Gemma 2's soft-capping) says why."""
    from attngeom.model.adapter import attention_w_o

    arch, lengths = FAMILIES[family]
    calls = _recorded_calls(_family(arch), lengths)
    assert calls
    for module, c in calls:
        reason = routes.unsupported(c["q"], c["k"], c["mask"], c["softcap"])
        if arch == "gemma2":
            assert reason is not None and "soft-capping" in reason
            continue
        assert reason is None, reason
        H = c["q"].shape[1]
        w_o = attention_w_o(module).detach().double()
        scale = c["scaling"] if c["scaling"] is not None else c["q"].shape[-1] ** -0.5
        mask = c["mask"]
        if mask is not None:
            mask = mask.expand(c["q"].shape[0], 1, -1, -1)
        _check_layer(dict(q=c["q"], k=c["k"], v=c["v"], scale=scale, mask=mask, lengths=torch.tensor(lengths),
                          window=c["window"],
                          G=F.gram(w_o, H), G_full=F.full_gram(w_o),
                          sinks=None if c["sinks"] is None else c["sinks"].detach().double()))


# --------------------------------------------------------------------------------------------
# End to end: the summaries on the fused route against the block path's
# --------------------------------------------------------------------------------------------


def _summaries(model, lengths, route, T=20, dtype=torch.float32):
    """``(HeadStats table, TokenStats table, the session's routes)`` of one padded batch."""
    from attngeom.capture.session import Session
    from attngeom.model import ModelHandle
    from attngeom.streaming.passes import forward
    from attngeom.streaming.reducers import HeadStats, InputBatch, TokenStats
    from tiny_models import tiny_tokenizer

    handle = ModelHandle(model=model.to(dtype), tokenizer=tiny_tokenizer(), spec="tiny", name="tiny")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 128, (len(lengths), T), generator=g)
    ids[:, 0] = 1
    ids = ids * (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None])
    batch = InputBatch(ids=ids, lengths=torch.tensor(lengths), index=list(range(len(lengths))))
    heads, tokens = HeadStats(), TokenStats()
    for r in (heads, tokens):
        r.begin(batch)
    session = Session(observers=[heads, tokens], route=route)
    forward(handle, batch, session)
    for r in (heads, tokens):
        r.end(batch)
    return heads.result(), tokens.result(), dict(session.routes)


def _assert_tables_close(got, want, rtol, atol, exact=()):
    assert list(got.columns) == list(want.columns) and len(got) == len(want)
    for c in got.columns:
        if c in exact:
            assert (got[c].to_numpy() == want[c].to_numpy()).all(), c
        elif got[c].dtype.kind == "f":
            torch.testing.assert_close(torch.tensor(got[c].to_numpy()), torch.tensor(want[c].to_numpy()),
                                       rtol=rtol, atol=atol, msg=c)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_summaries_on_the_fused_route_equal_the_block_paths(family):
    """float32: HeadStats (every column, the source winners included) and TokenStats (every column)
    on ``route="fused"`` equal the block path's to float32 rounding; each layer's route is recorded
    (Gemma 2's soft-capped layers: the block path, and why)."""
    arch, lengths = FAMILIES[family]
    model = _family(arch)
    heads_f, tokens_f, taken = _summaries(model, lengths, "fused")
    heads_b, tokens_b, block = _summaries(model, lengths, "block")
    assert set(block.values()) == {"block"} and set(taken) == set(block)
    if arch == "gemma2":
        assert all(r.startswith("block: soft-capping") for r in taken.values())
    else:
        assert set(taken.values()) == {"fused"}
    winners = ("winner_self", "winner_sink", "winner_other", "queries")
    _assert_tables_close(heads_f, heads_b, rtol=1e-4, atol=1e-5, exact=winners)
    _assert_tables_close(tokens_f, tokens_b, rtol=1e-4, atol=1e-5)


def test_the_summaries_in_bf16_stay_within_bf16_rounding_of_the_block_paths():
    """bf16: the fused kernels run in bf16 (float32 accumulation), the block path mixes the
    bf16-rounded weights (docs/precision.md): the means differ by bf16 rounding only (measured here:
    at most 1.6 % of the largest value of a column; a winner share by one query per head, a near tie)."""
    model = _family("llama")
    heads_f, tokens_f, taken = _summaries(model, [20, 13], "fused", dtype=torch.bfloat16)
    heads_b, tokens_b, _ = _summaries(model, [20, 13], "block", dtype=torch.bfloat16)
    assert set(taken.values()) == {"fused"}
    cols = [c for c in heads_f.columns if c not in ("layer", "head", "queries") and not c.startswith("winner_")]
    _assert_tables_close(heads_f[cols], heads_b[cols], rtol=2e-2, atol=2e-2)
    _assert_tables_close(tokens_f, tokens_b, rtol=3e-2, atol=3e-2)


def test_an_observer_that_reads_blocks_keeps_every_layer_on_the_block_path():
    from attngeom.streaming.reducers import FullCapture, HeadStats

    from attngeom.capture.session import Session
    from attngeom.streaming.passes import forward
    from attngeom.streaming.reducers import InputBatch
    from attngeom.model import ModelHandle
    from tiny_models import tiny_tokenizer

    handle = ModelHandle(model=_family("llama"), tokenizer=tiny_tokenizer(), spec="tiny", name="tiny")
    ids = torch.randint(4, 128, (1, 9))
    batch = InputBatch(ids=ids, lengths=torch.tensor([9]), index=[0])
    full, heads = FullCapture(), HeadStats()
    for r in (full, heads):
        r.begin(batch)
    session = Session(observers=[heads, full], route="fused")
    forward(handle, batch, session)
    assert set(session.routes.values()) == {"block: FullCapture reads blocks"}
    assert len(full.layers) == handle.num_layers
    with pytest.raises(InputError, match="route must be one of"):
        Session(route="fast")



@pytest.mark.parametrize("route", ["fused", "block"])
def test_the_summaries_stage_records_the_route_of_every_layer(route):
    """``summaries`` (the stage of ``attngeom analyze``) takes the route asked and writes the route
    each layer took in the heads table; a soft-capped layer asked to fuse says why it took blocks."""
    from attngeom.streaming.stages import summaries
    from tiny_models import tiny_model

    texts = [[1, 5, 9, 13, 7, 22, 40, 8, 9], [1, 30, 31, 32, 33, 34]]
    for arch in ("llama", "gemma2"):
        handle = tiny_model(arch)
        heads, tokens = summaries(handle, None, texts, route=route, batch_size=2)
        want = {l: route for l in range(handle.num_layers)}
        if arch == "gemma2" and route == "fused":
            want = {l: "block: soft-capping (the fused kernels have no score_mod)" for l in want}
        assert heads.groupby("layer")["route"].first().to_dict() == want
        assert heads["route"].notna().all() and len(tokens) == handle.num_layers * 15


def test_a_fused_layer_handed_its_mask_whole_says_so_in_the_record():
    """Causal with right padding, and a sliding window over it, take the kernels' causal flag or
    bands (route ``fused``); left padding is neither, so the kernels take the whole ``[T, T]`` mask
    (exact, quadratic in memory): the session's routes and :class:`RouteRecord` say so, and the
    logits equal the block path's."""
    from attngeom.capture.session import Session, attngeom_attention_implementation
    from attngeom.streaming.reducers import HeadStats, InputBatch, RouteRecord
    from tiny_models import tiny_model

    right = _random_case(3, lengths=[13, 9])
    assert routes.FusedLayer(right["q"], right["k"], right["v"], right["scale"], right["mask"], right["G"],
                             right["G_full"], right["lengths"]).route == "fused"
    band = _random_case(4, T=40, lengths=[40, 31], window=6)
    assert routes.FusedLayer(band["q"], band["k"], band["v"], band["scale"], band["mask"], band["G"],
                             band["G_full"], band["lengths"], window=6).route == "fused"

    handle = tiny_model("llama")
    ids = torch.randint(4, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :3] = 0                                                      # left padding
    batch = InputBatch(ids=ids, lengths=torch.tensor([9, 9]), index=[0, 1])
    logits = {}
    for route in ("fused", "block"):
        record, heads = RouteRecord(), HeadStats()
        for r in (record, heads):
            r.begin(batch)
        session = Session(observers=[heads, record], route=route)
        with torch.no_grad(), attngeom_attention_implementation(handle.model), session.active(batch.lengths):
            logits[route] = handle.model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits
        want = routes.WHOLE_MASK_ROUTE if route == "fused" else "block"
        assert set(session.routes.values()) == {want} and len(session.routes) == handle.num_layers
        assert record.result() == session.routes
        if route == "fused":         # a later batch without padding: the record keeps both routes
            with torch.no_grad(), attngeom_attention_implementation(handle.model), session.active(batch.lengths):
                handle.model(input_ids=ids, use_cache=False)
            assert set(session.routes.values()) == {"fused"}
            assert set(record.result().values()) == {f"{routes.WHOLE_MASK_ROUTE}; fused"}
    real = attention_mask.bool()           # a padded query's row is the kernels' choice: never read
    torch.testing.assert_close(logits["fused"][real], logits["block"][real], rtol=1e-4, atol=1e-5)
