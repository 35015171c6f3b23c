"""Selection geometry (SPEC §5): bounds, hand-computed examples, a slow reference loop, the sink-aware
regime and its prediction, the reducer on a tiny model and the CLI's bad-input errors."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attngeom import selection as SEL
from attngeom.streaming.reducers import FullCapture
from attngeom.streaming import stream

from tiny_models import tiny_model

# ------------------------------------------------------------------------------------------------
# A slow, obviously-correct reference
# ------------------------------------------------------------------------------------------------


def slow_scores(y: np.ndarray, selected: list[int], distance: str) -> dict:
    """P, R, F, GInv for one head and one selection, by loops (float64)."""
    S = len(y)
    s = np.zeros_like(y[0])
    for j in selected:
        s = s + y[j]
    D = []
    for j in range(S):
        if distance == "euclidean":
            D.append(math.sqrt(sum((y[j][k] - s[k]) ** 2 for k in range(len(s)))))
        else:
            dot = sum(y[j][k] * s[k] for k in range(len(s)))
            ny = math.sqrt(sum(x * x for x in y[j]))
            ns = math.sqrt(sum(x * x for x in s))
            D.append(1 - dot / (ny * ns + 1e-12))
    sel = set(selected)
    rho_max = max(D[j] for j in sel)
    rho_min = min(D[j] for j in range(S) if j not in sel)
    N = len(sel)
    fp = sum(1 for j in range(S) if j not in sel and D[j] <= rho_max)
    tp = sum(1 for j in sel if D[j] < rho_min)
    P = N / (N + fp)
    R = tp / N
    F = 2 * P * R / (P + R)
    ginv = sum(1 for i in sel for j in range(S) if j not in sel and D[j] <= D[i])
    return {"P": P, "R": R, "F": F, "ginv": ginv, "rho_max": rho_max, "rho_min": rho_min}


def slow_topn(a: np.ndarray, N: int) -> list[int]:
    """Top-N by attention, ties to the earlier position."""
    return sorted(range(len(a)), key=lambda j: (-a[j], j))[:N]


def _random_case(seed: int, H: int = 3, S: int = 23, d: int = 5, ties: bool = False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(H, S, generator=g, dtype=torch.float64) * 2
    if ties:  # repeated attention values: top-N must break ties to the earlier position
        logits = torch.round(logits)
    a = torch.softmax(logits, -1)
    v = torch.randn(H, S, d, generator=g, dtype=torch.float64)
    return a, v


# ------------------------------------------------------------------------------------------------
# Bounds of SPEC §5 on random configurations
# ------------------------------------------------------------------------------------------------

def _check_bounds(seed: int, H: int, S: int, d: int, discrete: bool, repeats: int) -> int:
    """SPEC §5's bounds on one random configuration; returns how many selections were checked."""
    g = torch.Generator().manual_seed(seed)
    if discrete:  # few distinct values: many exact ties in attention and in distances
        a = torch.randint(0, 3, (H, S), generator=g).double()
        a = (a + 0.5) / (a + 0.5).sum(-1, keepdim=True)
        v = torch.randint(-1, 2, (H, S, d), generator=g).double()
    else:
        a = torch.softmax(torch.randn(H, S, generator=g, dtype=torch.float64) * 3, -1)
        v = torch.randn(H, S, d, generator=g, dtype=torch.float64) * torch.rand(H, S, 1, generator=g, dtype=torch.float64)
    y = a[..., None] * v
    ns = list(range(1, S))  # every N below the candidate count
    orders = torch.cat([SEL.topn_order(a), SEL.random_orders((repeats * H,), S, g)], 0)
    y_all = torch.cat([y, y.repeat(repeats, 1, 1)], 0)
    res = SEL.geometry(y_all, orders, ns)
    N = torch.tensor(ns, dtype=torch.float64)[None, :]
    checked = 0
    for dist, r in res.items():
        G = r["ginv"].double()
        assert SEL.bound_violations(r, ns) == 0
        assert torch.all(r["P"] >= N / (N + G) - 1e-12)
        assert torch.all(r["R"] >= (1 - G / N).clamp_min(0) - 1e-12)
        perfect = (r["P"] == 1) & (r["R"] == 1)
        assert torch.equal(G == 0, perfect)
        assert torch.all((r["F"] >= 0) & (r["F"] <= 1))
        checked += r["P"].numel()
    return checked


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), H=st.integers(1, 4), S=st.integers(2, 48), d=st.integers(1, 6),
       discrete=st.booleans(), repeats=st.integers(1, 4))
def test_bounds_hold_on_random_configurations(seed, H, S, d, discrete, repeats):
    _check_bounds(seed, H, S, d, discrete, repeats)


def test_bounds_checked_on_thousands_of_selections():
    """The same bounds on a fixed grid of configurations (independent of the property test, so the
    outcome does not depend on which tests ran before)."""
    checked = sum(_check_bounds(seed, 1 + seed % 4, 8 + 5 * seed, 1 + seed % 6, seed % 2 == 0, 1 + seed % 3)
                  for seed in range(8))
    assert checked >= 2000


def test_bound_violations_detects_a_broken_result():
    r = {"P": torch.tensor([[0.2]]), "R": torch.tensor([[1.0]]), "ginv": torch.tensor([[1]])}
    assert SEL.bound_violations(r, [2]) == 1  # P = 0.2 < 2/3
    r = {"P": torch.tensor([[1.0]]), "R": torch.tensor([[1.0]]), "ginv": torch.tensor([[0]])}
    assert SEL.bound_violations(r, [2]) == 0


# ------------------------------------------------------------------------------------------------
# F_1 = 1 and hand-computed examples
# ------------------------------------------------------------------------------------------------


def test_f1_is_one_in_euclidean_space():
    for seed in range(5):
        a, v = _random_case(seed, H=4, S=31, d=7)
        y = a[..., None] * v
        for order in (SEL.topn_order(a), SEL.random_orders((4,), 31, torch.Generator().manual_seed(seed))):
            r = SEL.geometry(y, order, [1, 2, 4])["euclidean"]
            assert torch.all(r["F"][:, 0] == 1.0)
            assert torch.all(r["P"][:, 0] == 1.0) and torch.all(r["R"][:, 0] == 1.0)
            assert torch.all(r["ginv"][:, 0] == 0)


def _one_d(y_values, a_values):
    a = torch.tensor([a_values], dtype=torch.float64)
    y = torch.tensor(y_values, dtype=torch.float64)
    v = (y / a[0][:, None])[None]  # v such that a_j v_j = y_j
    return a, v


def test_hand_computed_euclidean():
    # y = (1.0, 0.9, 5.0, 1.5) on a line, attention 0.4 > 0.3 > 0.2 > 0.1
    a, v = _one_d([[1.0], [0.9], [5.0], [1.5]], [0.4, 0.3, 0.2, 0.1])
    y = a[..., None] * v
    r = SEL.geometry(y, SEL.topn_order(a), [2, 3])["euclidean"]
    # N=2: s = 1.9, D = (0.9, 1.0, 3.1, 0.4): rho_max 1.0, rho_min 0.4
    #      P = 2/(2+1), R = 0/2, F = 0, GInv = 1 + 1
    # N=3: s = 6.9, D = (5.9, 6.0, 1.9, 5.4): rho_max 6.0, rho_min 5.4
    #      P = 3/4, R = 1/3, F = 2(3/4)(1/3)/(3/4+1/3) = 6/13, GInv = 1 + 1 + 0
    assert r["P"][0].tolist() == pytest.approx([2 / 3, 3 / 4])
    assert r["R"][0].tolist() == pytest.approx([0.0, 1 / 3])
    assert r["F"][0].tolist() == pytest.approx([0.0, 6 / 13])
    assert r["ginv"][0].tolist() == [2, 2]
    assert r["rho_max"][0].tolist() == pytest.approx([1.0, 6.0])
    assert r["rho_min"][0].tolist() == pytest.approx([0.4, 5.4])


def test_hand_computed_cosine():
    # y0 = (1, 0), y1 = (1, 1), y2 = (-1, 0), y3 = (3, 1.4); attention 0.5 > 0.3 > 0.15 > 0.05
    a, v = _one_d([[1.0, 0.0], [1.0, 1.0], [-1.0, 0.0], [3.0, 1.4]], [0.5, 0.3, 0.15, 0.05])
    y = a[..., None] * v
    r = SEL.geometry(y, SEL.topn_order(a), [1, 2])["cosine"]
    # N=1: s = y0; D = (0, 1 - 1/sqrt2, 2, 1 - 3/sqrt(10.96)) -> P = R = F = 1
    # N=2: s = (2, 1); D0 = 1 - 2/sqrt5 = 0.1056, D1 = 1 - 3/sqrt10 = 0.0513, D2 = 1 + 2/sqrt5,
    #      D3 = 1 - 7.4/(sqrt(10.96) sqrt5) = 0.00037 -> rho_max = D0, rho_min = D3
    #      P = 2/3 (y3 is closer), R = 0, F = 0, GInv = 2
    assert r["F"][0, 0] == 1.0
    assert r["P"][0, 1] == pytest.approx(2 / 3)
    assert r["R"][0, 1] == 0.0 and r["F"][0, 1] == 0.0
    assert int(r["ginv"][0, 1]) == 2
    assert float(r["rho_max"][0, 1]) == pytest.approx(1 - 2 / math.sqrt(5))
    assert float(r["rho_min"][0, 1]) == pytest.approx(1 - 7.4 / (math.sqrt(10.96) * math.sqrt(5)))


def test_top_n_ties_go_to_the_earlier_position():
    a = torch.tensor([[0.1, 0.3, 0.3, 0.3]])
    assert SEL.topn_order(a)[0].tolist() == [1, 2, 3, 0]


# ------------------------------------------------------------------------------------------------
# Against the slow loop
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ties", [False, True])
def test_vectorised_equals_slow_loop(ties):
    a, v = _random_case(7, H=3, S=21, d=4, ties=ties)
    y = a[..., None] * v
    ns = SEL.default_ns(21)
    g = torch.Generator().manual_seed(3)
    rnd = SEL.random_orders((3,), 21, g)
    for order, kind in ((SEL.topn_order(a), "topn"), (rnd, "random")):
        res = SEL.geometry(y, order, ns)
        for dist in SEL.DISTANCES:
            for h in range(3):
                for k, N in enumerate(ns):
                    chosen = slow_topn(a[h].numpy(), N) if kind == "topn" else order[h, :N].tolist()
                    ref = slow_scores(y[h].numpy(), chosen, dist)
                    for key in ("P", "R", "F", "ginv"):
                        assert float(res[dist][key][h, k]) == pytest.approx(ref[key], abs=1e-12), (kind, dist, h, N, key)
                    for key in ("rho_max", "rho_min"):
                        assert float(res[dist][key][h, k]) == pytest.approx(ref[key], abs=1e-7)


@pytest.mark.parametrize("chunk", [None, 1])
def test_rows_taken_in_chunks_equal_the_slow_loop(chunk, monkeypatch):
    """One :func:`geometry` call over a top-N set and two random sets of the same heads, with the
    rows taken all at once (``None``) or one set of ``G`` rows at a time (``1``): every row against
    the slow loop, and both ways the same counts."""
    if chunk is not None:
        monkeypatch.setattr("attngeom.selection.separation.GEOMETRY_ELEMENTS", chunk)
    a, v = _random_case(9, H=3, S=25, d=4, ties=True)
    y = a[..., None] * v
    ns = SEL.default_ns(25)
    order = torch.cat([SEL.topn_order(a), SEL.random_orders((6,), 25, torch.Generator().manual_seed(5))])
    res = SEL.geometry(y, order, ns)
    for dist in SEL.DISTANCES:
        assert res[dist]["P"].shape == (9, len(ns))
        for m in range(9):
            h = m % 3
            for k, N in enumerate(ns):
                ref = slow_scores(y[h].numpy(), order[m, :N].tolist(), dist)
                for key in ("P", "R", "F", "ginv"):
                    assert float(res[dist][key][m, k]) == pytest.approx(ref[key], abs=1e-12), (dist, m, N, key)
                for key in ("rho_max", "rho_min"):
                    assert float(res[dist][key][m, k]) == pytest.approx(ref[key], abs=1e-7)


def test_gram_path_equals_vector_path():
    a, v = _random_case(11, H=2, S=30, d=6)
    y = a[..., None] * v
    ns = SEL.default_ns(30)
    order = SEL.topn_order(a)
    r1 = SEL.geometry(y, order, ns)
    r2 = SEL.geometry_from_gram(y @ y.transpose(1, 2), order, ns)
    for dist in SEL.DISTANCES:
        for key in ("P", "R", "F", "ginv"):
            assert torch.equal(r1[dist][key].double(), r2[dist][key].double())


def test_analyse_query_rows_and_sink_exclusion():
    a, v = _random_case(5, H=2, S=20, d=3)
    g = torch.Generator().manual_seed(0)
    res = SEL.analyse_query(a, v, has_sink=True, repeats=8, generator=g)
    df = pd.DataFrame(res.rows)
    assert res.violations == 0
    assert set(df["kind"]) == set(SEL.SELECTION_KINDS)
    assert sorted(df[df.kind == "topn"]["N"].unique()) == [1, 2, 4, 8, 16]       # N < 20
    assert sorted(df[df.kind == "topn_nosink"]["N"].unique()) == [1, 2, 4, 8, 16]  # N < 19
    # the sink-excluded top-N equals the slow loop over sources 1..19
    y = (a[..., None] * v).numpy()
    row = df[(df.kind == "topn_nosink") & (df.distance == "euclidean") & (df["head"] == 1) & (df.N == 4)].iloc[0]
    chosen = slow_topn(a[1, 1:].numpy(), 4)
    ref = slow_scores(y[1, 1:], chosen, "euclidean")
    assert row["F"] == pytest.approx(ref["F"]) and row["ginv"] == ref["ginv"]
    # predictions only beside the top-N kinds
    assert df[df.kind.str.startswith("topn")]["F_pred"].notna().all()
    assert df[df.kind.str.startswith("random")]["F_pred"].isna().all()
    # random rows: means over 8 repeats of uniformly random subsets
    assert df[df.kind == "random"]["F_std"].notna().all()


# ------------------------------------------------------------------------------------------------
# Sink-aware regime and prediction
# ------------------------------------------------------------------------------------------------


def _model_values(n: int, lam: float, kappa: float, sink_norm: float, d: int | None = None, seed: int = 0):
    """Values whose cosines are exactly the model's: exp(-lam|i-j|) among non-sink, kappa with the sink."""
    S = n + 1
    pos = torch.arange(n, dtype=torch.float64)
    C = torch.eye(S, dtype=torch.float64)
    C[1:, 1:] = torch.exp(-lam * (pos[:, None] - pos[None, :]).abs())
    C[0, 1:] = C[1:, 0] = kappa
    L = torch.linalg.cholesky(C)          # rows = unit vectors with Gram C
    v = L.clone()
    v[0] *= sink_norm
    return v


def test_sink_regime_recovers_constructed_parameters():
    n, lam, kappa = 60, 0.15, -0.3
    v = _model_values(n, lam, kappa, sink_norm=0.25)[None]            # [1, S, S]
    # attention: sink 0.4, middle level m, recency window of 6 at level r
    w, r = 6, 0.05
    m = (1 - 0.4 - w * r) / (n - w)
    a = torch.tensor([[0.4] + [m] * (n - w) + [r] * w], dtype=torch.float64)
    p = SEL.sink_regime(a, v, has_sink=True)
    assert float(p["norm_ratio"][0]) == pytest.approx(4.0)
    assert float(p["sink_cos"][0]) == pytest.approx(kappa)
    assert float(p["norm_cv"][0]) == pytest.approx(0.0, abs=1e-6)
    assert float(p["lam"][0]) == pytest.approx(lam, rel=0.02)
    assert float(p["lam_mae"][0]) < 5e-3
    assert int(p["recent_window"][0]) == w
    assert float(p["middle_level"][0]) == pytest.approx(m)
    assert float(p["recent_level"][0]) == pytest.approx(r)
    assert float(p["sink_mass"][0]) == pytest.approx(0.4)
    assert float(p["profile_r2"][0]) == pytest.approx(1.0)


def test_lag_cosines_equal_a_loop_over_pairs():
    g = torch.Generator().manual_seed(3)
    u = torch.randn(3, 50, 7, generator=g, dtype=torch.float64)
    u = u / u.norm(dim=-1, keepdim=True)
    lags = SEL.default_lags(50, max_lag=40)
    got = SEL.lag_cosines(u, lags)
    for h in range(3):
        for k, lag in enumerate(lags):
            ref = sum(float(u[h, j] @ u[h, j + lag]) for j in range(50 - lag)) / (50 - lag)
            assert float(got[h, k]) == pytest.approx(ref, abs=1e-12)


def test_model_gram_is_the_gram_of_model_vectors_and_prediction_uses_it():
    n, lam, kappa = 40, 0.2, -0.2
    params = {"lam": torch.tensor([lam]), "sink_cos": torch.tensor([kappa]), "norm_ratio": torch.tensor([5.0]),
              "sink_mass": torch.tensor([0.5]), "middle_level": torch.tensor([0.01]),
              "recent_level": torch.tensor([0.03]), "recent_window": torch.tensor([5])}
    a_hat, K = SEL.model_gram(params, n, has_sink=True)
    v = _model_values(n, lam, kappa, sink_norm=0.2)
    y = a_hat[0][:, None] * v
    assert torch.allclose(K[0], y @ y.T, atol=1e-12)
    assert a_hat[0, 0] == 0.5 and torch.allclose(a_hat[0, -5:], torch.full((5,), 0.03, dtype=torch.float64))
    ns = SEL.default_ns(n + 1)
    pred = SEL.predict_curves(params, n, ns, SEL.default_ns(n), has_sink=True)
    ref = SEL.geometry_from_gram(K, SEL.topn_order(a_hat), ns)
    for dist in SEL.DISTANCES:
        for key in ("P", "R", "F", "ginv"):
            assert torch.equal(pred["topn"][dist][key], ref[dist][key])
    refn = SEL.geometry_from_gram(K[:, 1:, 1:].contiguous(), SEL.topn_order(a_hat[:, 1:]), SEL.default_ns(n))
    assert torch.equal(pred["topn_nosink"]["euclidean"]["F"], refn["euclidean"]["F"])


def test_best_small_n():
    F = torch.tensor([[0.5, 0.9, 0.9, 0.2, 1.0], [1.0, 0.2, 0.3, 0.4, 0.1]])
    assert SEL.best_small_n(F, [1, 2, 4, 8, 16], small_n_max=8).tolist() == [2, 8]          # N >= 2 by default
    assert SEL.best_small_n(F, [1, 2, 4, 8, 16], small_n_max=8, small_n_min=1).tolist() == [2, 1]
    sel = pd.DataFrame({"window": 0, "layer": 0, "query": 9, "head": [0] * 5, "kind": "topn", "distance": "cosine",
                        "N": [1, 2, 4, 8, 16], "F": F[0].numpy(), "F_pred": F[1].numpy()})
    bt = SEL.best_small_n_table(sel, small_n_max=8)
    assert bt["best_n"].tolist() == [2] and bt["best_n_pred"].tolist() == [8]


# ------------------------------------------------------------------------------------------------
# The reducer on a tiny model
# ------------------------------------------------------------------------------------------------

TEXTS = ["The cat sat on the mat; the dog lay by the door.", "A short one, with commas."]


def test_reducer_last_query_matches_slow_loop_on_captured_maps(tiny_llama):
    red = SEL.SelectionStats(repeats=2, predict=False, dtype=torch.float64)
    cap = FullCapture()
    stream(tiny_llama, TEXTS, [red, cap], batch_size=2, progress=False)
    sel, reg = red.result()
    assert red.violations == 0
    L, H = tiny_llama.num_layers, tiny_llama.num_heads
    assert set(sel["layer"]) == set(range(L)) and set(sel["head"]) == set(range(H))
    lengths = [len(tiny_llama.encode(t)) for t in TEXTS]
    assert sorted(set(zip(sel["window"], sel["query"]))) == [(0, lengths[0] - 1), (1, lengths[1] - 1)]
    maps = cap.result()
    b, t = 1, lengths[1] - 1
    for layer in (0, L - 1):
        a = maps[layer]["a"][b, :, t, : t + 1].double()
        v = maps[layer]["v"][b, :, : t + 1].double()
        y = (a[..., None] * v).numpy()
        for h in range(H):
            for N in (1, 4, 16):
                ref = slow_scores(y[h], slow_topn(a[h].numpy(), N), "cosine")
                row = sel[(sel.window == b) & (sel.layer == layer) & (sel["head"] == h) & (sel.N == N)
                          & (sel.kind == "topn") & (sel.distance == "cosine")].iloc[0]
                assert row["P"] == pytest.approx(ref["P"]) and row["R"] == pytest.approx(ref["R"])
                assert row["ginv"] == ref["ginv"]
    assert len(reg) == 2 * L * H


def test_reducer_all_and_sampled_queries(tiny_llama):
    red = SEL.SelectionStats(repeats=1, queries="all", ns=[1, 2, 4], predict=False)
    stream(tiny_llama, ["Short one."], [red], layers=[0], progress=False)
    sel, reg = red.result()
    T = len(tiny_llama.encode("Short one."))
    assert sorted(sel["query"].unique()) == list(range(1, T))
    assert (sel["N"] < sel["query"] + 1).all()
    red2 = SEL.SelectionStats(repeats=1, queries=3, ns=[1, 2], predict=False)
    stream(tiny_llama, TEXTS, [red2], layers=[1], progress=False)
    s2, _ = red2.result()
    per_window = s2.groupby("window")["query"].nunique()
    assert (per_window == 3).all()


def test_sliding_window_model_runs_without_violations():
    mistral = tiny_model("mistral")  # sliding window 8: far queries cannot see the sink
    red = SEL.SelectionStats(repeats=2)
    stream(mistral, TEXTS, [red], progress=False)
    sel, reg = red.result()
    assert red.violations == 0 and len(sel)
    assert (reg["candidates"] <= 8).all() and not reg["has_sink"].any()


@pytest.mark.parametrize("ties,chunk", [(False, None), (True, None), (True, 1000)])
def test_scores_count_inversions_exactly_on_both_paths(ties, chunk, monkeypatch):
    """GInv, the P and R counts and ρ against brute-force pair counts, for sizes below and above the
    switch from comparing to binary search (N = 32 / 64), with and without tied distances; with
    ``chunk`` the compared pairs are split into chunks of rows (here one row of 32 x 100 per chunk)."""
    if chunk is not None:
        monkeypatch.setattr(SEL, "COMPARE_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(4)
    M, S = 6, 100
    D = torch.rand(M, 2, S, generator=g, dtype=torch.float64)
    if ties:
        D = (D * 8).floor() / 8
    order = torch.stack([torch.randperm(S, generator=g) for _ in range(M)])
    ns = torch.tensor([32, 64])
    D = D[:, :1].expand(M, 2, S).contiguous()
    got = SEL.scores(D, order, ns)
    for m in range(M):
        for k, n in enumerate(ns.tolist()):
            sel = set(order[m, :n].tolist())
            d = D[m, k].tolist()
            ins = [d[i] for i in sel]
            outs = [d[j] for j in range(S) if j not in sel]
            ginv = sum(1 for i in ins for j in outs if j <= i)
            assert int(got["ginv"][m, k]) == ginv
            rho_max, rho_min = max(ins), min(outs)
            assert float(got["rho_max"][m, k]) == rho_max and float(got["rho_min"][m, k]) == rho_min
            assert float(got["P"][m, k]) == pytest.approx(n / (n + sum(1 for j in outs if j <= rho_max)))
            assert float(got["R"][m, k]) == pytest.approx(sum(1 for i in ins if i < rho_min) / n)
