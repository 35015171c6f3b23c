"""The metric registry: one entry makes a metric everywhere; blocks compute only what observers need."""

import numpy as np
import pytest
import torch

from attngeom.metrics import formulas as M
from attngeom.metrics import registry as R
from attngeom.capture.blocks import Block, LayerState
from attngeom.errors import InputError
from attngeom.capture.interventions import RANK_METRICS, RankIntervention, Variant
from attngeom.streaming.reducers import HeadStats, Reducer, TokenStats
from attngeom.traces.trace import analyze
from attngeom.streaming import stream

TEXTS = ["a b c d e f g h i j k l m n", "the cat sat on the mat while the dog slept"]
ATTENTION_FIELDS = ("sink_rate", "self_attention", "entropy")


@pytest.fixture
def toy_metric():
    """A toy metric, ``a_ij^h ‖v_j^h‖²`` in head space: one registry entry, removed afterwards."""
    metric = R.register(R.Metric("toy", "toy metric", lambda b: b.a * b.state.raw_value_norm[
        :, :, b.k_start:b.k_start + b.a.shape[-1]].unsqueeze(-2) ** 2, frozenset({"attention", "raw_value_norm"})))
    yield metric
    R.unregister("toy")


SPEC_METRICS = ("attention", "value_weighted", "output_normalized", "contribution", "contribution_inter")
"""The five metrics of SPEC §2, in its order: the table starts with them; what follows may grow."""


def test_the_table_starts_with_the_spec_metrics():
    assert R.names()[:5] == SPEC_METRICS
    assert R.get("contribution").token_map == "contribution_inter" and R.get("attention").heads == "mean"
    assert R.label("output_normalized") == "output-normalised" and R.label("random") == "random"
    with pytest.raises(KeyError, match="known: attention"):
        R.get("nope")
    with pytest.raises(ValueError, match="unknown quantities"):
        R.Metric("bad", "bad", lambda b: b.a, frozenset({"no_such_quantity"}))


@pytest.mark.parametrize("name", R.names())
def test_every_registered_metric_has_the_properties_its_readers_rely_on(name):
    """What every entry of the table satisfies, whatever it is: a metric added to the table is held
    to these without editing this test."""
    m = R.get(name)
    assert m.name == name and name.isidentifier() and not name.startswith("_")
    assert isinstance(m.label, str) and m.label and R.label(name) == m.label
    assert m.heads in ("sum", "mean")
    assert R.closure([name]) >= m.needs and set(m.needs) <= set(R.QUANTITIES) | set(R.METRICS)
    assert m.layer_only == (m.per_head is None) and (m.per_head is not None or m.token is not None)
    assert (name in R.per_head_names()) == (not m.layer_only)
    if m.token_map is not None:                      # the token-level score comes from a per-head map
        assert not R.get(m.token_map).layer_only
    # the lists other modules read are the entries' flags, nothing else
    assert (name in R.rank_names()) == m.rank and (name in RANK_METRICS) == m.rank
    assert (name in R.received_names()) == m.received and (name in TokenStats().metrics) == m.received
    if m.received:                                   # summed over queries in one product, without a map
        assert not m.layer_only and m.prepare is None and m.token is None
    assert (name in R.hierarchy()) == (m.hierarchy is not None)
    assert (name in R.rivals()) == bool(m.rival)
    assert (R.prepared_names([name]) == (name,)) == (m.prepare is not None)
    if m.prepare is not None:                        # a pass before the forward: a backward, or a rollout of a metric
        kind, _, of = m.prepare.partition(":")
        assert kind in ("gradient", "rollout") and (kind == "gradient" or of in R.METRICS)


def test_the_lists_keep_the_table_order():
    assert tuple(RANK_METRICS) == R.rank_names() + ("random",)
    assert R.received_names() == tuple(n for n in R.names() if R.get(n).received)
    assert R.rivals() == tuple(n for n in R.names() if R.get(n).rival)
    places = [R.get(n).hierarchy for n in R.hierarchy()]
    assert places == sorted(places) and len(set(places)) == len(places)       # least faithful first, no tie
    assert TokenStats().metrics == R.received_names()
    assert R.hierarchy() == SPEC_METRICS[:4]          # the contribution-weights paper's four (SPEC §2)


def test_a_registered_metric_is_everywhere(tiny_llama, toy_metric):
    trace = analyze(tiny_llama, TEXTS[1])
    lt = trace.layers[0]
    a, vn = lt.a.numpy(), lt.v.norm(dim=-1).numpy()
    expected = a * vn[:, None, :] ** 2
    # LayerTrace: attribute, by name, token level (summed over heads)
    assert np.allclose(lt.toy, expected, atol=1e-6)
    assert np.array_equal(lt.metric("toy"), lt.toy)
    assert np.allclose(lt.token_score("toy"), expected.sum(0), atol=1e-5)
    # Block: attribute and by name
    block = lt.block
    assert torch.equal(block.toy, block.metric("toy"))
    # what a source receives, through the generic path
    w = torch.ones(1, a.shape[1])
    assert torch.allclose(block.received(w, ["toy"])["toy"][0], torch.from_numpy(expected.sum((0, 1))), atol=1e-5)
    # the rankings of the interventions (and so faithfulness and the CLI)
    assert "toy" in RANK_METRICS and RANK_METRICS[-1] == "random"
    v = Variant("toy", "comprehensiveness", 0.5)
    m = RankIntervention(v).mask(block)
    k = torch.div(torch.arange(1, a.shape[1] + 1), 2, rounding_mode="floor")
    assert torch.equal(m[0, 0].sum(-1), k)
    # the top-ranked sources are the ones with the highest token-level toy score
    score = torch.from_numpy(lt.token_score("toy"))
    i = a.shape[1] - 1
    top = torch.topk(score[i], int(k[i])).indices
    assert bool(m[0, 0, i, top].all())
    assert R.label("toy") == "toy metric"


def test_unknown_metric_is_refused_everywhere(tiny_llama):
    lt = analyze(tiny_llama, TEXTS[0]).layers[0]
    with pytest.raises(InputError, match="unknown metric"):
        lt.metric("toy")
    with pytest.raises(KeyError):
        lt.block.metric("toy")
    with pytest.raises(AttributeError):
        lt.toy
    with pytest.raises(InputError):
        Variant("toy", "comprehensiveness", 0.5)


def test_received_fast_path_equals_score_maps(tiny_llama):
    """The one-product sums over queries equal the sums of the token-level score maps."""
    block = analyze(tiny_llama, TEXTS[1]).layers[1].block
    w = torch.rand(1, block.a.shape[2], generator=torch.Generator().manual_seed(0))
    fast = block.received(w)
    for name in R.received_names():
        slow = (w.unsqueeze(1) @ block.token_score(name)).squeeze(1)
        assert torch.allclose(fast[name], slow, atol=1e-5), name
        assert torch.allclose(block.received(w, [name])[name], slow, atol=1e-5), name


class Spy(Reducer):
    """Records, after the other observers, which quantities each block computed."""

    needs = frozenset()

    def __init__(self):
        self.computed: set[str] = set()
        self.blocks = 0

    def observe(self, block: Block) -> None:
        self.blocks += 1
        self.computed |= set(block._cache)
        if "value_norm" in block.state.__dict__:
            self.computed.add("value_norm")


HEAD_SPACE_KEYS = {"uG", "hon2", "hon", "p", "pu", "o2", "o", "share", "value_norm", "value_weighted",
                   "output_normalized", "contribution", "contribution_inter"}


def _count_head_space_calls(monkeypatch) -> dict:
    calls = {"n": 0}
    for name in ("quad", "pulled_back", "layer_output", "projected_value_norm", "contribution_from",
                 "contribution_inter_from", "contribution_column", "contribution_inter_column"):
        fn = getattr(M, name)

        def counted(*args, fn=fn, **kw):
            calls["n"] += 1
            return fn(*args, **kw)
        monkeypatch.setattr(M, name, counted)
    return calls


def test_attention_level_reducers_compute_no_head_space_product(tiny_llama, monkeypatch):
    heads = HeadStats(fields=ATTENTION_FIELDS)
    tokens = TokenStats(metrics=("attention",), columns=("sink_rate", "entropy"))
    assert R.needs_of([heads, tokens]) <= R.ATTENTION_LEVEL
    calls = _count_head_space_calls(monkeypatch)
    spy = Spy()
    stream(tiny_llama, TEXTS, [heads, tokens, spy], batch_size=2, progress=False, block_elements=100)
    assert spy.blocks > 0
    assert not (spy.computed & HEAD_SPACE_KEYS), spy.computed
    assert calls["n"] == 0
    # and the full reducers do compute them (the spy and the counters see it)
    spy = Spy()
    stream(tiny_llama, TEXTS, [HeadStats(), TokenStats(), spy], batch_size=2, progress=False, block_elements=100)
    assert {"uG", "p", "value_norm"} <= spy.computed and calls["n"] > 0
    assert not R.needs_of([HeadStats(), TokenStats()]) <= R.ATTENTION_LEVEL


def test_subsets_of_columns_equal_the_full_reducers(tiny_llama):
    full_h, full_t = HeadStats(), TokenStats()
    part_h = HeadStats(fields=ATTENTION_FIELDS)
    part_t = TokenStats(metrics=("attention", "contribution"), columns=("entropy",))
    stream(tiny_llama, TEXTS, [full_h, full_t, part_h, part_t], batch_size=2, progress=False, block_elements=100)
    fh, ph = full_h.result(), part_h.result()
    assert list(ph.columns) == ["layer", "head", "queries", *ATTENTION_FIELDS]
    assert np.allclose(fh[list(ATTENTION_FIELDS)].to_numpy(), ph[list(ATTENTION_FIELDS)].to_numpy())
    ft, pt = full_t.result(), part_t.result()
    cols = ["attention_received", "contribution_received", "entropy"]
    assert list(pt.columns) == ["text", "layer", "position", "token_id", *cols]
    assert np.allclose(ft[cols].to_numpy(), pt[cols].to_numpy(), atol=1e-6)
    with pytest.raises(ValueError):
        HeadStats(fields=("nope",))
    with pytest.raises(ValueError):
        TokenStats(columns=("nope",))


def test_closure_and_declarations():
    assert R.closure(["head_share"]) >= {"head_share", "pulled_back", "head_output", "attention"}
    assert R.closure(["contribution"]) >= {"uG", "pulled_back"}     # token level is the inter-head map
    assert R.needs_of([HeadStats(), object()]) is None                # an observer without needs
    assert "entropy" in R.needs_of([TokenStats(columns=("entropy",), metrics=())])


def test_block_metric_names_come_from_the_table():
    a = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    v = torch.randn(1, 2, 3, 4)
    w_o = torch.randn(5, 8)
    state = LayerState(layer=0, module=None, value=v, w_o=w_o, G=M.gram(w_o, 2), G_full=M.full_gram(w_o),
                       kv_head=torch.arange(2), lengths=torch.tensor([3]))
    block = Block(state=state, a=a, q_start=0, k_start=0)
    prepared = R.prepared_names(R.METRICS)
    for name in R.per_head_names():
        if name in prepared:            # computed before the forward: refused without its pass
            with pytest.raises(InputError, match="computed from the clean forward"):
                block.metric(name)
            continue
        assert block.metric(name).shape == a.shape
        assert torch.equal(getattr(block, name), block.metric(name))
    for name in R.METRICS:
        if name not in prepared:
            assert block.token_score(name).shape == (1, 3, 3)
    # with its maps (by absolute position) the block reads its part of them
    state.prepared = {"grad_attention": torch.arange(18.0).reshape(1, 2, 3, 3), "rollout": torch.eye(3)[None]}
    part = Block(state=state, a=a[:, :, 1:], q_start=1, k_start=0)
    assert torch.equal(part.metric("grad_attention"), torch.arange(18.0).reshape(1, 2, 3, 3)[:, :, 1:])
    assert torch.equal(part.token_score("rollout"), torch.eye(3)[None, 1:])
    with pytest.raises(InputError, match="defined on the layer"):
        block.alti
    with pytest.raises(AttributeError):
        block.no_such_metric
