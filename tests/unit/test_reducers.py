"""Reducers against slow references computed from the full maps of :func:`attngeom.traces.trace.analyze`.

The winner shares of :class:`HeadStats` (SPEC §6, ``argmax_j a_ij n_j``) are computed without an
``argmax`` pass; here they are checked against ``argmax`` itself on every architecture, across block
sizes, with padding, and on exact ties (where ``argmax`` takes the first maximum)."""

import pytest
import torch

from attngeom.capture.blocks import Block, LayerState

from attngeom.capture.session import Session
from attngeom.streaming.reducers import InputBatch, HeadStats
from attngeom.traces.trace import analyze
from attngeom.streaming import forward
from test_capture import _ids
from tiny_models import ARCHS, tiny_model

T = 24
WINNERS = ("winner_self", "winner_sink", "winner_other")


def _reference_winners(a: torch.Tensor, norms: torch.Tensor, sink: int = 0) -> dict[str, torch.Tensor]:
    """Loop reference: per head, the share of queries ``i > 0`` whose ``argmax_j a_ij n_j`` is ``i``,
    the sink, or another source. ``a [H, T, T]``, ``norms [H, T]`` -> ``{column: [H]}``."""
    H, n, _ = a.shape
    out = {k: torch.zeros(H, dtype=torch.float64) for k in WINNERS}
    for h in range(H):
        for i in range(1, n):
            j = int(torch.argmax(a[h, i] * norms[h]))
            key = "winner_self" if j == i else "winner_sink" if j == sink else "winner_other"
            out[key][h] += 1.0 / (n - 1)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_elements", [None, 200])
def test_winner_shares_equal_an_argmax_reference(arch, block_elements):
    handle = tiny_model(arch)
    ids = _ids(handle)
    trace = analyze(handle, ids)
    for winner_norm in ("raw", "projected"):
        stats = HeadStats(fields=WINNERS, winner_norm=winner_norm)
        batch = InputBatch(ids=ids[None], lengths=torch.tensor([T]), index=[0])
        stats.begin(batch)
        forward(handle, batch, Session(observers=[stats], block_elements=block_elements))
        got = stats.result()
        for lt in trace.layers:
            v = torch.as_tensor(lt.v)
            norms = v.norm(dim=-1) if winner_norm == "raw" else torch.as_tensor(lt.value_norm).float()
            ref = _reference_winners(torch.as_tensor(lt.a), norms)
            rows = got[got.layer == lt.index].sort_values("head")
            for k in WINNERS:
                assert torch.allclose(torch.tensor(rows[k].to_numpy()), ref[k], atol=1e-9), (arch, lt.index, k)


def test_winner_shares_with_padding_equal_one_text_at_a_time():
    handle = tiny_model("llama")
    texts = [_ids(handle, n, seed=n) for n in (9, 17)]
    n = max(len(t) for t in texts)
    ids = torch.zeros(2, n, dtype=torch.long)
    for b, t in enumerate(texts):
        ids[b, : len(t)] = t
    batch = InputBatch(ids=ids, lengths=torch.tensor([len(t) for t in texts]), index=[0, 1])
    both = HeadStats(fields=WINNERS)
    both.begin(batch)
    forward(handle, batch, Session(observers=[both], block_elements=150))
    sums = {}
    for t in texts:
        one = HeadStats(fields=WINNERS)
        single = InputBatch(ids=t[None], lengths=torch.tensor([len(t)]), index=[0])
        one.begin(single)
        forward(handle, single, Session(observers=[one]))
        for layer, s in one.sums.items():
            for k in WINNERS:
                sums.setdefault((layer, k), torch.zeros_like(s[k]))
                sums[(layer, k)] += s[k]
    for (layer, k), s in sums.items():
        assert torch.allclose(both.sums[layer][k], s, atol=1e-9), (layer, k)


def _block(a: torch.Tensor, v: torch.Tensor, q_start: int = 0, k_start: int = 0, allowed=None) -> Block:
    B, H, Q, S = a.shape
    d = v.shape[-1]
    state = LayerState(layer=0, module=None, value=v, w_o=torch.eye(H * d), G=torch.eye(d).expand(H, d, d),
                       G_full=torch.eye(H * d), kv_head=torch.arange(H),
                       lengths=torch.full((B,), max(q_start + Q, k_start + S)))
    return Block(state=state, a=a, q_start=q_start, k_start=k_start, allowed=allowed)


def _winners_of(block: Block, sink: int = 0) -> dict[str, torch.Tensor]:
    stats = HeadStats(fields=WINNERS, sink=sink)
    per_query = stats.per_query(block)
    return {k: per_query[k]() for k in WINNERS}


def test_exact_ties_go_to_the_first_maximum_as_argmax_does():
    # one head, queries 0..3 over sources 0..3, all value norms 1: ties are ties of a itself
    a = torch.tensor([[[[1.0, 0.0, 0.0, 0.0],
                        [0.5, 0.5, 0.0, 0.0],      # sink ties self: argmax -> 0 (sink)
                        [0.2, 0.4, 0.4, 0.0],      # other (1) ties self (2): argmax -> 1 (other)
                        [0.1, 0.2, 0.3, 0.4]]]])   # self alone
    v = torch.ones(1, 1, 4, 2) / 2**0.5
    w = _winners_of(_block(a, v))
    assert w["winner_sink"][0, 0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert w["winner_self"][0, 0].tolist() == [1.0, 0.0, 0.0, 1.0]   # query 0 is both (never counted)
    assert w["winner_other"][0, 0, 1:].tolist() == [0.0, 1.0, 0.0]


def test_ties_after_the_query_and_a_sink_past_the_first_column():
    # a bidirectional block (every source visible): a tie with a later source goes to the query,
    # and with sink=1 a tie between column 0 and the sink goes to column 0 ("other")
    a = torch.tensor([[[[0.3, 0.3, 0.1, 0.3],      # q0: 0 ties 1 and 3 -> 0 (self)
                        [0.4, 0.4, 0.1, 0.1],      # q1: 0 ties sink 1 -> 0 (other)
                        [0.1, 0.2, 0.35, 0.35],    # q2: self ties later 3 -> 2 (self)
                        [0.1, 0.6, 0.1, 0.2]]]])   # q3: sink alone
    v = torch.ones(1, 1, 4, 2)
    allowed = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    w = _winners_of(_block(a, v, allowed=allowed), sink=1)
    ref = {"winner_self": [1.0, 0.0, 1.0, 0.0], "winner_sink": [0.0, 0.0, 0.0, 1.0]}
    for k, expected in ref.items():
        assert w[k][0, 0].tolist() == expected, k
    for i in range(4):
        j = int(torch.argmax(a[0, 0, i]))
        assert (j == i) == bool(w["winner_self"][0, 0, i]) and (j == 1) == bool(w["winner_sink"][0, 0, i])


def test_a_block_that_starts_after_the_sink_and_the_value_norms_weigh_the_winner():
    # queries 4..5 see sources 2..5 only; the sink (0) is outside the block
    g = torch.Generator().manual_seed(0)
    a = torch.rand(1, 2, 2, 4, generator=g)
    a = a / a.sum(-1, keepdim=True)
    v = torch.rand(1, 2, 6, 3, generator=g) * torch.tensor([1.0, 5.0, 1.0, 1.0, 1.0, 1.0])[:, None]
    allowed = torch.ones(1, 1, 2, 4, dtype=torch.bool)
    w = _winners_of(_block(a, v, q_start=4, k_start=2, allowed=allowed))
    norms = v.norm(dim=-1)[:, :, 2:]
    winner = (a * norms.unsqueeze(-2)).argmax(-1) + 2                    # absolute positions
    assert torch.equal(w["winner_self"], (winner == torch.tensor([4, 5])).float())
    assert float(w["winner_sink"].abs().sum()) == 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_received_sums_equal_the_score_maps_on_every_architecture(arch):
    """``Block.received`` (one product per group of heads sharing values, or per head by the
    ``[Q, S]`` map when a group has fewer queries than dimensions) against the sums of the
    token-level score maps, on the live blocks of every architecture (grouped-query ones included),
    in blocks of few queries and in one block per layer: both ways of summing the contribution run."""
    from attngeom.metrics import formulas as M
    from attngeom.metrics import registry as R

    handle = tiny_model(arch)
    cfg = handle.model.config
    n_rep = cfg.num_attention_heads // getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    seen, by_map = [], set()

    class Check:
        def observe(self, block):
            assert block.state.n_rep == n_rep
            w = torch.rand(block.shape[0], block.shape[2], generator=torch.Generator().manual_seed(block.q_start))
            fast = block.received(w)
            for name in R.received_names():
                slow = (w.unsqueeze(1) @ block.token_score(name)).squeeze(1)
                assert torch.allclose(fast[name], slow, atol=1e-5, rtol=1e-5), (arch, block.layer, name)
            seen.append(block.layer)
            by_map.add(M.contribution_by_map(n_rep, block.shape[2], block.v.shape[-1]))

    ids = _ids(handle)
    for budget in (300, 1 << 24):
        forward(handle, InputBatch(ids=ids[None], lengths=torch.tensor([T]), index=[0]),
                Session(observers=[Check()], block_elements=budget))
    assert sorted(set(seen)) == list(range(cfg.num_hidden_layers))
    assert by_map == {True, False}, by_map


def test_a_loaded_merged_state_keeps_observing():
    """A reducer loaded with merged records (``merge_sums``: its counts come back as numpy scalars)
    observes more texts; its sums then equal one reducer that saw every text."""
    from attngeom.heads.taxonomy import TaxonomyStats
    from attngeom.runs.run import merge_sums

    handle = tiny_model("llama")
    texts = [_ids(handle, n, seed=n) for n in (9, 13)]

    def seen(reducer, t):
        batch = InputBatch(ids=t[None], lengths=torch.tensor([len(t)]), index=[0])
        reducer.begin(batch)
        forward(handle, batch, Session(observers=[reducer]))
        return reducer

    for make in (HeadStats, TaxonomyStats):
        first = seen(make(), texts[0])
        loaded = seen(make().load_state(merge_sums([first.state()])), texts[1])
        both = seen(seen(make(), texts[0]), texts[1])
        assert float(loaded.counts[0]) == float(both.counts[0]) > 0
        for layer, sums in both.sums.items():
            for k, s in sums.items():
                assert torch.allclose(loaded.sums[layer][k], s, atol=1e-12), (make.__name__, layer, k)
        merged = make().merge(first) if make is TaxonomyStats else None      # merge: sums on either side's device
        if merged is not None:
            merged.merge(seen(make(), texts[1]))
            assert float(merged.counts[0]) == float(both.counts[0])
