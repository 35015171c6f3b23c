"""Geometry of token selection (SPEC §5, paper 2): precision, recall and F of top-N selections.

For one query ``t`` of one layer and every head ``h`` (vectorised over heads and over ``N``), with
``a [H, S]`` the attention row over the query's candidate sources and ``v [H, S, d]`` their value
states in head space: the attention-scaled values ``y_j = a_tj v_j``, the selections (top-``N``
by attention, ties to the earlier position; the same without the sink; seeded random subsets) and
``s_N``, ``D_j``, ``P_N``, ``R_N``, ``F_N``, ``GInv_N`` and their bounds are defined in SPEC §5.
``N`` runs over ``1, 2, 4, …, 256`` below the number of candidates.

Everything is computed from three quantities per selection: ``⟨s_N, y_j⟩``, ``‖s_N‖²`` and
``‖y_j‖²``. From vectors they come from prefix sums of the ``y``'s in selection order; from a Gram
matrix ``K_jk = ⟨y_j, y_k⟩`` (the sink-aware prediction below) from prefix sums of its rows. The same
scoring code then serves measurement and prediction.

**Sink-aware regime** (SPEC §5): :func:`sink_regime` measures the value norms, the value cosines
and their ``exp(−λ δ)`` fit and the three-piece attention profile at the query;
:func:`predict_curves` turns them into the model's Gram matrix and predicts ``P_N, R_N, F_N``
with the same scoring code; :func:`best_small_n` picks the best small ``N``, predicted and measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from attngeom.capture.plugin import Block
from attngeom.errors import InputError
from attngeom.runs.contract import ExperimentResult, ModelHandleLike, RunLike
from attngeom.streaming.reducers import Batch, Reducer
from attngeom.selection.settings import DISTANCES, POWERS, SelectionSettings

KINDS = ("topn", "random", "topn_nosink", "random_nosink")
EPS = 1e-12


def default_ns(count: int, ns: Sequence[int] = POWERS) -> list[int]:
    """The sizes of ``ns`` below ``count`` candidates."""
    return [int(n) for n in ns if 1 <= n < count]


def check_ns(ns: Iterable[int], window: int) -> list[int]:
    """Validate user sizes against the window length (before any compute)."""
    ns = sorted(set(int(n) for n in ns))
    if not ns:
        raise InputError("no selection size N given")
    bad = [n for n in ns if n < 1]
    if bad:
        raise InputError(f"N must be at least 1, got {bad[0]}")
    too_big = [n for n in ns if n >= window]
    if too_big:
        raise InputError(f"N={too_big[0]} is not below the window length {window}: a query sees at most "
                         f"{window} sources, and a selection must leave at least one out")
    return ns


# --------------------------------------------------------------------------------------------
# Selection orders
# --------------------------------------------------------------------------------------------


def topn_order(a: torch.Tensor) -> torch.Tensor:
    """Sources by decreasing attention, ties to the earlier position: ``[..., S]`` -> indices."""
    return torch.sort(a, dim=-1, descending=True, stable=True).indices


def random_orders(shape: tuple[int, ...], S: int, generator: torch.Generator) -> torch.Tensor:
    """Independent uniform random permutations of ``S`` sources: ``[*shape, S]``."""
    return torch.rand(*shape, S, generator=generator, dtype=torch.float64).argsort(-1)


def ranks_of(order: torch.Tensor) -> torch.Tensor:
    """Inverse permutation: ``rank[..., order[..., r]] = r``."""
    rank = torch.empty_like(order)
    ar = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank.scatter_(-1, order, ar)
    return rank


# --------------------------------------------------------------------------------------------
# The geometry of one batch of selections
# --------------------------------------------------------------------------------------------


def _distances(dots: torch.Tensor, ss: torch.Tensor, yy: torch.Tensor, distance: str) -> torch.Tensor:
    """``D [M, K, S]`` from ``dots = ⟨s_N, y_j⟩ [M, K, S]``, ``ss = ‖s_N‖² [M, K]``, ``yy = ‖y_j‖² [M, S]``."""
    if distance == "euclidean":
        return (yy[:, None, :] + ss[:, :, None] - 2 * dots).clamp_min(0).sqrt()
    if distance == "cosine":
        return 1 - dots / (yy.clamp_min(0).sqrt()[:, None, :] * ss.clamp_min(0).sqrt()[:, :, None] + EPS)
    raise InputError(f"unknown distance {distance!r}; choose from {', '.join(DISTANCES)}")


def scores(D: torch.Tensor, order: torch.Tensor, ns: torch.Tensor) -> dict[str, torch.Tensor]:
    """P, R, F, GInv, ρ_max, ρ_min for distances ``D [M, K, S]``; the selection of size ``ns[k]`` is
    the first ``ns[k]`` sources of ``order [M, S]``. Every result is ``[M, K]``.

    Counting, not sorting all sources: with ``U`` the unselected distances, ``ρ_min = min U``,
    ``|{j∉S : D_j <= ρ_max}|`` is a comparison over ``U`` and ``R_N`` counts the selected ``i`` with
    ``D_i < ρ_min``. ``GInv_N = Σ_{j∉S} |{i∈S : D_i >= D_j}|`` (the same pairs ``D_j <= D_i``,
    counted from the other side) is one binary search of every ``D_j`` among the ``N`` sorted selected
    distances (a comparison with each of them, for ``N <=`` :data:`COMPARE_MAX_N`), so only ``max(N)``
    values per row are sorted."""
    M, K, S = D.shape
    top = int(ns.max())
    N = ns.to(D.dtype)[None, :]
    idx = order[:, None, :top].expand(M, K, top)
    d_sel = D.gather(-1, idx)                                               # [M, K, top]
    valid = torch.arange(top, device=D.device)[None, None, :] < ns[None, :, None]
    unsel = D.scatter(-1, idx, torch.where(valid, torch.full_like(d_sel, math.inf), d_sel))  # selected -> +inf
    rho_min = unsel.amin(-1)
    sel_sorted = d_sel.masked_fill(~valid, -math.inf).sort(-1).values      # padding -> -inf, first
    rho_max = sel_sorted[..., -1]
    false_pos = (unsel <= rho_max[..., None]).sum(-1)
    true_pos = ((d_sel < rho_min[..., None]) & valid).sum(-1)
    ginv = torch.stack([_pairs_at_or_above(unsel[:, k], sel_sorted[:, k, top - n:])   # 0 at +inf
                        for k, n in enumerate(ns.tolist())], 1)
    P = N / (N + false_pos.to(D.dtype))
    R = true_pos.to(D.dtype) / N
    F = 2 * P * R / (P + R)  # P > 0 always
    return {"P": P, "R": R, "F": F, "ginv": ginv, "rho_max": rho_max, "rho_min": rho_min}


COMPARE_MAX_N = 32
"""Up to this many selected distances GInv compares every pair; beyond, it binary-searches."""
COMPARE_ELEMENTS = 1 << 20
"""Pairs compared per chunk: a larger boolean temporary leaves the cache (and, past a few MB, costs
fresh pages on every call); measured in docs/benchmark-analyze.md ("Measurements behind constants")."""


def _pairs_at_or_above(u: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """``Σ_j |{i : sel_i >= u_j}|`` per row: ``u [M, S]`` the unselected distances, ``sel [M, n]`` the
    selected ones sorted ascending -> ``[M]`` int64. Few selected: every pair compared, in chunks of
    rows of at most :data:`COMPARE_ELEMENTS` pairs; more: one binary search of every ``u_j``."""
    M, S = u.shape
    n = sel.shape[1]
    if n > COMPARE_MAX_N:
        return (n - torch.searchsorted(sel.contiguous(), u.contiguous())).sum(-1)
    step = max(1, COMPARE_ELEMENTS // max(1, n * S))
    return torch.cat([(u[r:r + step, None, :] <= sel[r:r + step, :, None]).sum((-1, -2))
                      for r in range(0, M, step)])


def _selection_masks(order: torch.Tensor, ns: torch.Tensor) -> torch.Tensor:
    """``sel [M, K, S]``: source ``j`` is among the first ``N_k`` of ``order``."""
    return ranks_of(order)[:, None, :] < ns[None, :, None]


GEOMETRY_ELEMENTS = 1 << 16
"""Distances ``[rows, K, S]`` computed at a time by :func:`geometry` (whole sets of ``n_sets`` rows,
at least one): 512 KiB in float64, so that the dozen passes over them stay in the cache and no large
temporary is paged in afresh (all rows at once against one set at a time, measured in
docs/benchmark-analyze.md, "Measurements behind constants"). The chunks change only how the
``⟨s_N, y_j⟩`` products are batched, i.e. their last bits."""


def geometry(y: torch.Tensor, order: torch.Tensor, ns: Sequence[int],
             distances: Sequence[str] = DISTANCES) -> dict[str, dict[str, torch.Tensor]]:
    """Selection geometry from vectors. ``y [n_sets, S, d]`` attention-scaled values (``n_sets`` sets
    of values), ``order [M, S]`` with ``M`` a multiple of ``n_sets`` (row ``m`` orders the sources of
    ``y[m % n_sets]``; so several selections of the same heads, e.g. random repeats, share one
    ``y``): a permutation of the sources, a selection of size N being its first N entries; ``ns``
    sizes ``< S``.

    Returns ``{distance: {"P"|"R"|"F"|"ginv"|"rho_max"|"rho_min": [M, K]}}``. Every row is computed
    on its own, so the rows are taken a few whole sets of ``n_sets`` at a time
    (:data:`GEOMETRY_ELEMENTS`)."""
    n_sets, S, d = y.shape
    M = order.shape[0]
    if M % n_sets:
        raise ValueError(f"{M} orders for {n_sets} value sets: not a multiple")
    nt = torch.as_tensor(list(ns), dtype=torch.long, device=y.device)
    yy = (y * y).sum(-1)
    step = n_sets * max(1, GEOMETRY_ELEMENTS // (n_sets * len(nt) * S))
    parts = [_geometry_rows(y, yy, order[m0:m0 + step], nt, distances) for m0 in range(0, M, step)]
    if len(parts) == 1:
        return parts[0]
    return {dist: {k: torch.cat([p[dist][k] for p in parts]) for k in parts[0][dist]} for dist in distances}


def _geometry_rows(y: torch.Tensor, yy: torch.Tensor, order: torch.Tensor, nt: torch.Tensor,
                   distances: Sequence[str]) -> dict[str, dict[str, torch.Tensor]]:
    """:func:`geometry` of ``order [C·n_sets, S]`` (whole sets of ``n_sets`` rows);
    ``yy [n_sets, S] = ‖y_j‖²``."""
    n_sets, S, d = y.shape
    M = order.shape[0]
    C = M // n_sets
    K, top = len(nt), int(nt.max())
    src = torch.arange(M, device=y.device) % n_sets
    ys = y[src[:, None], order[:, :top]]                          # only the first max(N) are ever summed
    s = ys.cumsum(1)[:, nt - 1]                                   # s_N: [M, K, d]
    dots = torch.matmul(s.reshape(C, n_sets, K, d), y.transpose(1, 2)).reshape(M, K, S)
    ss = (s * s).sum(-1)
    return _scores_per_distance(dots, ss, yy.repeat(C, 1), order, nt, distances)


def geometry_from_rows(rows: torch.Tensor, diag: torch.Tensor, order: torch.Tensor, ns: Sequence[int],
                       distances: Sequence[str] = DISTANCES) -> dict[str, dict[str, torch.Tensor]]:
    """Selection geometry from Gram rows in selection order: ``rows [M, n, S]`` with
    ``rows[m, r] = K[m, order[m, r]]`` for ``r < n`` (``n >= max(ns)``), ``diag [M, S] = K_jj``."""
    nt = torch.as_tensor(list(ns), dtype=torch.long, device=rows.device)
    # Σ_{i∈S_N} K_ij: [M, K, S], as running sums of the segments between consecutive sizes (the
    # prefix sums at the K sizes only, never all max(N) of them)
    prefix, total, start = {}, torch.zeros_like(rows[:, 0]), 0
    for n in sorted(set(nt.tolist())):
        total = total + rows[:, start:n].sum(1)
        prefix[n], start = total, n
    dots = torch.stack([prefix[n] for n in nt.tolist()], 1)
    sel = _selection_masks(order, nt)
    ss = (dots * sel).sum(-1)
    return _scores_per_distance(dots, ss, diag, order, nt, distances)


def _scores_per_distance(dots: torch.Tensor, ss: torch.Tensor, yy: torch.Tensor, order: torch.Tensor,
                         nt: torch.Tensor, distances: Sequence[str]) -> dict[str, dict[str, torch.Tensor]]:
    """:func:`scores` for every distance from one ``(dots, ss, yy)`` (shapes of :func:`_distances`),
    in ONE call: the distances' ``D`` stacked along the rows (every score is per row, so the results
    are those of one call per distance, with half the small operations)."""
    M = order.shape[0]
    if not distances:
        return {}
    D = torch.cat([_distances(dots, ss, yy, dist) for dist in distances])
    r = scores(D, order.repeat(len(distances), 1), nt)
    return {dist: {k: x[i * M:(i + 1) * M] for k, x in r.items()} for i, dist in enumerate(distances)}


def geometry_from_gram(K: torch.Tensor, order: torch.Tensor, ns: Sequence[int],
                       distances: Sequence[str] = DISTANCES) -> dict[str, dict[str, torch.Tensor]]:
    """Selection geometry from a Gram matrix ``K [M, S, S]`` (``K_jk = ⟨y_j, y_k⟩``); otherwise as
    :func:`geometry` (equal to it for ``K = y yᵀ``)."""
    M, S, _ = K.shape
    top = max(ns)
    rows = K.gather(1, order[:, :top, None].expand(M, top, S))
    return geometry_from_rows(rows, K.diagonal(dim1=1, dim2=2), order, ns, distances)


def bound_violations(r: dict[str, torch.Tensor], ns: Sequence[int], tol: float = 1e-9) -> int:
    """How many selections break a bound of SPEC §5 (must be 0)."""
    N = torch.as_tensor(list(ns), dtype=r["P"].dtype)[None, :]
    g = r["ginv"].to(r["P"].dtype)
    bad_p = r["P"] < N / (N + g) - tol
    bad_r = r["R"] < (1 - g / N).clamp_min(0) - tol
    perfect = (r["P"] == 1) & (r["R"] == 1)
    bad_eq = (g == 0) != perfect
    return int((bad_p | bad_r | bad_eq).sum())


# --------------------------------------------------------------------------------------------
# Sink-aware regime
# --------------------------------------------------------------------------------------------


def default_lags(n: int, max_lag: int = 256) -> list[int]:
    """Position distances used for the cosine-decay fit: 1..16, then about 8 per octave."""
    top = min(max_lag, n - 1)
    lags = set(range(1, min(16, top) + 1))
    x = 16.0
    while x < top:
        x *= 2 ** 0.125
        lags.add(min(top, int(round(x))))
    return sorted(lag for lag in lags if 1 <= lag <= top)


LAMBDA_GRID = torch.logspace(-4, 1.5, 600, dtype=torch.float64)


def fit_exp_decay(lags: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares ``λ`` of ``c(δ) ≈ exp(−λδ)`` for ``c [H, L]`` at ``lags [L]`` over a log grid
    (1e-4 .. 10^1.5, ~1 % steps), and the mean absolute error at that ``λ``: ``([H], [H])``."""
    model = torch.exp(-LAMBDA_GRID[:, None] * lags[None, :].double())    # [grid, L]
    err = ((c.double()[:, None, :] - model[None]) ** 2).sum(-1)          # [H, grid]
    best = err.argmin(-1)
    lam = LAMBDA_GRID[best]
    mae = (c.double() - model[best]).abs().mean(-1)
    return lam, mae


def attention_profile(a: torch.Tensor, has_sink: bool = True, max_window: int | None = None) -> dict[str, torch.Tensor]:
    """Piecewise-constant fit of an attention row ``a [H, S]`` (sources in position order, the sink
    first when ``has_sink``): sink weight, middle level, recency level and recency window ``w``
    (``1 <= w <= n−1`` for ``n`` non-sink sources, minimising the squared error; ``w = n`` when
    ``n == 1``). Returns ``[H]`` tensors and ``profile_r2`` (1 − SSE/SST over the non-sink sources)."""
    H, S = a.shape
    a = a.double()
    sink = a[:, 0] if has_sink else torch.zeros(H, dtype=a.dtype)
    b = a[:, 1:] if has_sink else a
    n = b.shape[1]
    if n <= 1:
        level = b.mean(-1) if n else torch.zeros(H, dtype=a.dtype)
        return {"sink_mass": sink, "middle_level": torch.zeros(H, dtype=a.dtype), "recent_level": level,
                "recent_window": torch.full((H,), n), "profile_r2": torch.ones(H, dtype=a.dtype)}
    c1 = torch.cat([torch.zeros(H, 1, dtype=a.dtype), b.cumsum(-1)], -1)       # [H, n+1]
    c2 = torch.cat([torch.zeros(H, 1, dtype=a.dtype), (b * b).cumsum(-1)], -1)
    wmax = n - 1 if max_window is None else max(1, min(n - 1, max_window))
    w = torch.arange(1, wmax + 1)
    split = n - w                                                         # middle = [0, split)
    s_mid, q_mid = c1[:, split], c2[:, split]
    s_rec, q_rec = c1[:, n:n + 1] - s_mid, c2[:, n:n + 1] - q_mid
    sse = (q_mid - s_mid ** 2 / split) + (q_rec - s_rec ** 2 / w)            # [H, W]
    best = sse.argmin(-1)
    wb = w[best]
    mid = s_mid.gather(1, best[:, None]).squeeze(1) / (n - wb)
    rec = s_rec.gather(1, best[:, None]).squeeze(1) / wb
    sst = (c2[:, n] - c1[:, n] ** 2 / n)
    r2 = torch.where(sst > 0, 1 - sse.gather(1, best[:, None]).squeeze(1) / sst.clamp_min(1e-300),
                     torch.ones_like(sst))
    return {"sink_mass": sink, "middle_level": mid, "recent_level": rec, "recent_window": wb, "profile_r2": r2}


def lag_cosines(unit: torch.Tensor, lags: Sequence[int]) -> torch.Tensor:
    """Mean cosine between unit vectors ``unit [H, n, d]`` at position distance ``δ`` for each lag:
    ``[H, L]`` (one product of the two shifted copies per lag; never the ``n × n`` matrix)."""
    H, n, d = unit.shape
    flat = unit.reshape(H, -1)
    out = torch.empty(H, len(lags), dtype=unit.dtype)
    for k, lag in enumerate(lags):
        out[:, k] = (flat[:, lag * d:] * flat[:, : (n - lag) * d]).sum(-1) / (n - lag)
    return out


def sink_regime(a: torch.Tensor, v: torch.Tensor, has_sink: bool = True, max_lag: int = 256,
                max_window: int | None = None) -> dict[str, torch.Tensor]:
    """The sink-aware regime parameters (module docstring) of one query: ``a [H, S]``, ``v [H, S, d]``
    over the candidates in position order, sink first when ``has_sink``. Returns ``[H]`` tensors."""
    H, S, d = v.shape
    v = v.float()
    norms = v.norm(dim=-1)                                         # [H, S]
    out: dict[str, torch.Tensor] = {}
    rest = norms[:, 1:] if has_sink else norms
    vr = v[:, 1:] if has_sink else v
    nan = torch.full((H,), float("nan"), dtype=torch.float64)
    if has_sink and S > 1:
        n0 = norms[:, 0].double()
        out["norm_ratio"] = torch.where(n0 > 0, rest.double().mean(-1) / n0.clamp_min(1e-300),
                                        torch.full_like(n0, math.inf))
        unit0 = v[:, 0] / norms[:, 0:1].clamp_min(1e-30)
        unit = vr / rest[..., None].clamp_min(1e-30)
        out["sink_cos"] = (unit @ unit0[..., None]).squeeze(-1).double().mean(-1)
    else:
        out["norm_ratio"], out["sink_cos"] = nan.clone(), nan.clone()
    out["norm_cv"] = (rest.double().std(-1, unbiased=False) / rest.double().mean(-1).clamp_min(1e-300)
                      if rest.shape[1] else nan.clone())
    n = vr.shape[1]
    lags = default_lags(n, max_lag)
    if lags:
        unit = vr / vr.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        c = lag_cosines(unit, lags)                                                  # [H, L]
        lt = torch.tensor(lags, dtype=torch.float64)
        lam, mae = fit_exp_decay(lt, c)
        out["lam"], out["lam_mae"] = lam, mae
        out["cos_lag1"] = c[:, 0].double()
        out["cos_far"] = c[:, -1].double()
    else:
        out["lam"], out["lam_mae"], out["cos_lag1"], out["cos_far"] = nan.clone(), nan.clone(), nan.clone(), nan.clone()
    out.update(attention_profile(a, has_sink, max_window))
    return out


def model_parts(params: dict[str, torch.Tensor], n: int, has_sink: bool = True,
                dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The sink-aware model's attention ``â [H, S]`` and scale ``â_j ν_j [H, S]`` for ``n`` non-sink
    sources (plus the sink first when ``has_sink``), so that ``K_jk = scale_j scale_k cos_jk``."""
    H = params["lam"].shape[0]
    w = params["recent_window"].long().clamp(0, n)
    pos = torch.arange(n)
    recent = pos[None, :] >= (n - w)[:, None]                                 # [H, n]
    a_rest = torch.where(recent, params["recent_level"].to(dtype)[:, None], params["middle_level"].to(dtype)[:, None])
    if not has_sink:
        return a_rest, a_rest.clone()
    ratio = params["norm_ratio"].to(dtype)
    nu0 = torch.where(torch.isfinite(ratio) & (ratio > 0), 1 / ratio, torch.zeros_like(ratio))
    a_hat = torch.cat([params["sink_mass"].to(dtype)[:, None], a_rest], 1)     # [H, n+1]
    nu = torch.cat([nu0[:, None], torch.ones(H, n, dtype=dtype)], 1)
    return a_hat, a_hat * nu


def model_rows(params: dict[str, torch.Tensor], scale: torch.Tensor, idx: torch.Tensor, has_sink: bool,
               drop_sink: bool = False) -> torch.Tensor:
    """Rows ``K[idx]`` of the model Gram matrix: ``scale [H, S]`` over the candidates, ``idx [H, r]``
    candidate indices -> ``[H, r, S]``. With ``has_sink`` index 0 is the sink (cosine ``κ`` with the
    others); ``drop_sink`` means the candidates are the non-sink sources only (positions 1..n)."""
    H, S = scale.shape
    lam = params["lam"].to(scale.dtype).nan_to_num(1.0)
    e = torch.exp(-lam[:, None] * torch.arange(S, dtype=scale.dtype)[None, :])       # [H, S] by lag
    j = torch.arange(S)
    lag = (idx[:, :, None] - j[None, None, :]).abs()                                  # [H, r, S]
    C = e.gather(1, lag.reshape(H, -1)).reshape(lag.shape)
    if has_sink and not drop_sink:
        kappa = params["sink_cos"].to(scale.dtype).nan_to_num(0.0)
        one_sink = (idx[:, :, None] == 0) ^ (j[None, None, :] == 0)
        C = torch.where(one_sink, kappa[:, None, None].expand_as(C), C)
    return scale.gather(1, idx)[:, :, None] * C * scale[:, None, :]


def model_gram(params: dict[str, torch.Tensor], n: int, has_sink: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole model Gram matrix ``K [H, S, S]`` and attention ``â [H, S]`` (for tests and plots)."""
    a_hat, scale = model_parts(params, n, has_sink)
    H, S = scale.shape
    idx = torch.arange(S).expand(H, S)
    return a_hat, model_rows(params, scale, idx, has_sink)


def predict_curves(params: dict[str, torch.Tensor], n: int, ns_with: Sequence[int], ns_without: Sequence[int],
                   distances: Sequence[str] = DISTANCES, has_sink: bool = True,
                   dtype: torch.dtype = torch.float64) -> dict[str, dict]:
    """Predicted ``P_N, R_N, F_N`` of the model's top-N, with the sink (when there is one) and without.

    Returns ``{"topn": {distance: scores}, "topn_nosink": {distance: scores}}`` (each ``[H, K]``)."""
    out = {}
    a_hat, scale = model_parts(params, n, has_sink, dtype)
    variants = [("topn", a_hat, scale, False, ns_with)]
    if has_sink:
        variants.append(("topn_nosink", a_hat[:, 1:], scale[:, 1:], True, ns_without))
    for kind, aa, sc, drop, ns_k in variants:
        if not ns_k:
            continue
        order = topn_order(aa)
        rows = model_rows(params, sc, order[:, : max(ns_k)], has_sink, drop_sink=drop)
        out[kind] = geometry_from_rows(rows, sc * sc, order, ns_k, distances)
    if not has_sink and "topn" in out:
        out["topn_nosink"] = out["topn"]
    return out


def best_small_n(F: torch.Tensor, ns: Sequence[int], small_n_max: int = 16, small_n_min: int = 2) -> torch.Tensor:
    """The ``N`` in ``small_n_min .. small_n_max`` with the largest ``F`` (ties to the smaller N):
    ``F [H, K]`` -> ``[H]`` (0 when no size is in range)."""
    keep = [k for k, n in enumerate(ns) if small_n_min <= n <= small_n_max]
    if not keep:
        return torch.zeros(F.shape[0], dtype=torch.long)
    sub = F[:, keep]
    idx = sub.argmax(-1)  # first maximum
    return torch.as_tensor([ns[k] for k in keep])[idx]


# --------------------------------------------------------------------------------------------
# One query, every head: measured + predicted
# --------------------------------------------------------------------------------------------


@dataclass
class QueryResult:
    """Selection geometry of one query: long-format rows and the regime parameters of each head."""

    rows: dict[str, np.ndarray]
    regime: dict[str, np.ndarray]
    violations: int
    selections: int


def analyse_query(a: torch.Tensor, v: torch.Tensor, has_sink: bool, ns: Sequence[int] = POWERS,
                  distances: Sequence[str] = DISTANCES, repeats: int = 8, generator: torch.Generator | None = None,
                  predict: bool = True, max_lag: int = 256, small_n_max: int = 16,
                  dtype: torch.dtype = torch.float64, random_without_sink: bool = True) -> QueryResult:
    """Everything of SPEC §5 for one query: ``a [H, S]`` attention over the candidates (position
    order, the sink first when ``has_sink``), ``v [H, S, d]`` their values.

    Rows: one per (kind, distance, head, N) with P, R, F, GInv, ρ_max, ρ_min (random kinds: means over
    ``repeats``, plus ``F_std``), and the predicted P, R, F for the top-N kinds (NaN elsewhere).
    ``random_without_sink=False`` skips the random control drawn from the non-sink candidates."""
    H, S, d = v.shape
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    a = a.to(dtype)
    v = v.to(dtype)
    y = a[..., None] * v
    sets = {"": (y, a, S)}
    if has_sink:
        sets["_nosink"] = (y[:, 1:], a[:, 1:], S - 1)
    ns_of = {suffix: default_ns(count, ns) for suffix, (_, _, count) in sets.items()}
    if not has_sink:
        ns_of["_nosink"] = ns_of[""]
    rows: dict[str, list] = {k: [] for k in ("kind", "distance", "head", "N", "P", "R", "F", "ginv",
                                             "rho_max", "rho_min", "F_std", "P_pred", "R_pred", "F_pred")}
    violations = selections = 0
    measured_topn: dict[str, dict] = {}

    def emit(kind, dist, res, ns_k, std=None, pred=None):
        K = len(ns_k)
        rows["kind"].append(np.full(H * K, kind, dtype=object))
        rows["distance"].append(np.full(H * K, dist, dtype=object))
        rows["head"].append(np.repeat(np.arange(H), K))
        rows["N"].append(np.tile(np.asarray(ns_k), H))
        for key in ("P", "R", "F", "ginv", "rho_max", "rho_min"):
            rows[key].append(res[key].double().reshape(-1).cpu().numpy())
        nanv = np.full(H * K, np.nan)
        rows["F_std"].append(nanv if std is None else std.reshape(-1).cpu().numpy())
        for key in ("P", "R", "F"):
            rows[f"{key}_pred"].append(nanv if pred is None else pred[key].double().reshape(-1).cpu().numpy())

    for suffix, (ys, aa, count) in sets.items():
        ns_k = ns_of[suffix]
        if not ns_k:
            continue
        reps = repeats if (suffix == "" or random_without_sink) else 0
        order_top = topn_order(aa)                                       # [H, S']
        orders = [order_top]
        if reps:
            orders.append(random_orders((reps * H,), count, generator))
        res = geometry(ys, torch.cat(orders, 0), ns_k, distances)
        for dist in distances:
            r = res[dist]
            violations += bound_violations(r, ns_k)
            selections += r["P"].numel()
            top = {k: x[:H] for k, x in r.items()}
            measured_topn[f"topn{suffix}/{dist}"] = top
            if reps:
                rnd = {k: x[H:].reshape(reps, H, -1).double().mean(0) for k, x in r.items()}
                std = r["F"][H:].reshape(reps, H, -1).double().std(0, unbiased=False)
                emit(f"random{suffix}", dist, rnd, ns_k, std=std)
        measured_topn[f"ns{suffix}"] = ns_k

    params = sink_regime(a, v, has_sink=has_sink, max_lag=max_lag)
    preds: dict = {}
    if predict:
        n_rest = S - 1 if has_sink else S
        preds = predict_curves(params, n_rest, ns_of[""], ns_of["_nosink"] if has_sink else [], distances, has_sink, dtype)
    for suffix in ("", "_nosink"):
        kind = f"topn{suffix}"
        if suffix == "_nosink" and not has_sink:
            src = ""
        else:
            src = suffix
        ns_k = ns_of[src] if src in ns_of else []
        if not ns_k or f"topn{src}/{distances[0]}" not in measured_topn:
            continue
        for dist in distances:
            pred = preds.get(kind, {}).get(dist) if predict else None
            emit(kind, dist, measured_topn[f"topn{src}/{dist}"], ns_k, pred=pred)
    regime = {k: x.double().cpu().numpy() for k, x in params.items()}
    regime["head"] = np.arange(H)
    for suffix in ("", "_nosink"):
        src = suffix if has_sink else ""
        ns_k = ns_of.get(src, [])
        if not ns_k:
            continue
        for dist in distances:
            key = f"topn{src}/{dist}"
            if key not in measured_topn:
                continue
            regime[f"best_n_{dist}{suffix}"] = best_small_n(measured_topn[key]["F"], ns_k, small_n_max).numpy()
            if predict and f"topn{suffix}" in preds:
                regime[f"best_n_pred_{dist}{suffix}"] = best_small_n(
                    preds[f"topn{suffix}"][dist]["F"], ns_k, small_n_max).numpy()
    cat = {k: np.concatenate(x) if x else np.array([]) for k, x in rows.items()}
    return QueryResult(rows=cat, regime=regime, violations=violations, selections=selections)


# --------------------------------------------------------------------------------------------
# The reducer
# --------------------------------------------------------------------------------------------


def _seed_of(*parts: int) -> int:
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFF)) * 1099511628211) % (1 << 61)
    return h


class SelectionStats(Reducer):
    """Selection geometry of SPEC §5 at chosen queries of every window, every layer and head.

    ``queries``: ``"last"`` (default: the last real token of each window), ``"all"`` (every query
    ``i >= 1``), or an integer ``k`` (a seeded sample of ``k`` queries per window, the last one
    always included). ``repeats`` random subsets per size (seeded from ``seed``, the window, the
    layer and the query, so results do not depend on batching). ``predict`` adds the sink-aware
    prediction. ``sink`` is the sink position (it is only treated as the sink when the query can see
    it). ``dtype``: the precision of the geometry (float32 by default; float64 for exact comparisons).
    ``random_without_sink``: also draw the random control from the non-sink candidates (default)."""

    STATE = ("frames", "regime_frames", "violations", "selections")

    def __init__(self, ns: Sequence[int] = SelectionSettings.ns, distances: Sequence[str] = SelectionSettings.distances,
                 repeats: int = SelectionSettings.repeats, seed: int = SelectionSettings.seed,
                 queries: str | int = SelectionSettings.queries, sink: int = SelectionSettings.sink,
                 predict: bool = SelectionSettings.predict, max_lag: int = SelectionSettings.max_lag,
                 small_n_max: int = SelectionSettings.small_n_max, dtype: torch.dtype = torch.float32,
                 random_without_sink: bool = SelectionSettings.random_without_sink):
        for dist in distances:
            if dist not in DISTANCES:
                raise InputError(f"unknown distance {dist!r}; choose from {', '.join(DISTANCES)}")
        if repeats < 0:
            raise InputError(f"repeats must be >= 0, got {repeats}")
        if not (queries in ("last", "all") or (isinstance(queries, int) and queries >= 1)):
            raise InputError(f"queries must be 'last', 'all' or a positive sample size, got {queries!r}")
        self.ns = sorted(set(int(n) for n in ns))
        self.distances = tuple(distances)
        self.repeats = int(repeats)
        self.seed = int(seed)
        self.queries = queries
        self.sink = int(sink)
        self.predict = bool(predict)
        self.max_lag = int(max_lag)
        self.small_n_max = int(small_n_max)
        self.dtype = dtype
        self.random_without_sink = bool(random_without_sink)
        self.frames: list[pd.DataFrame] = []
        self.regime_frames: list[pd.DataFrame] = []
        self.violations = 0
        self.selections = 0
        self._targets: list[set[int]] = []

    def begin(self, batch: Batch) -> None:
        super().begin(batch)
        self._targets = []
        for b, text in enumerate(batch.index):
            L = int(batch.lengths[b])
            if L < 2:
                self._targets.append(set())
            elif self.queries == "last":
                self._targets.append({L - 1})
            elif self.queries == "all":
                self._targets.append(set(range(1, L)))
            else:
                g = np.random.default_rng(_seed_of(self.seed, text, 7))
                k = min(int(self.queries), L - 1)
                pick = set(int(x) for x in g.choice(np.arange(1, L - 1), size=max(0, k - 1), replace=False)) if k > 1 else set()
                self._targets.append(pick | {L - 1})

    def observe(self, block: Block) -> None:
        B, H, Q, S = block.shape
        kpos = block.k_positions
        for b in range(B):
            ts = [t for t in self._targets[b] if block.q_start <= t < block.q_start + Q]
            for t in sorted(ts):
                qi = t - block.q_start
                if block.allowed is None:
                    vis = kpos <= t
                else:
                    vis = block.allowed[min(b, block.allowed.shape[0] - 1), 0, qi]
                idx = vis.nonzero().squeeze(-1)
                if idx.numel() < 2:
                    continue
                pos = kpos[idx]
                has_sink = bool(pos[0] == self.sink)
                a = block.a[b, :, qi, idx]
                v = block.v[b][:, idx]
                text = self.batch.index[b]
                g = torch.Generator().manual_seed(_seed_of(self.seed, text, block.layer, t))
                res = analyse_query(a, v, has_sink, self.ns, self.distances, self.repeats, g,
                                    self.predict, self.max_lag, self.small_n_max, self.dtype,
                                    self.random_without_sink)
                self.violations += res.violations
                self.selections += res.selections
                n = len(res.rows["N"])
                df = pd.DataFrame(res.rows)
                df.insert(0, "query", np.full(n, t))
                df.insert(0, "layer", np.full(n, block.layer))
                df.insert(0, "window", np.full(n, text))
                self.frames.append(df)
                rg = pd.DataFrame(res.regime)
                rg.insert(0, "candidates", np.full(H, idx.numel()))
                rg.insert(0, "has_sink", np.full(H, has_sink))
                rg.insert(0, "query", np.full(H, t))
                rg.insert(0, "layer", np.full(H, block.layer))
                rg.insert(0, "window", np.full(H, text))
                self.regime_frames.append(rg)

    def result(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """``(selection rows, regime rows)``."""
        sel = pd.concat(self.frames, ignore_index=True) if self.frames else pd.DataFrame()
        reg = pd.concat(self.regime_frames, ignore_index=True) if self.regime_frames else pd.DataFrame()
        if len(sel):
            for c in ("kind", "distance"):
                sel[c] = sel[c].astype(str)
        return sel, reg


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------


def best_small_n_table(sel: pd.DataFrame, small_n_min: int = 2, small_n_max: int = 16) -> pd.DataFrame:
    """Per (window, layer, query, head, top-N kind, distance): the measured and the predicted best small N
    (largest F over ``small_n_min <= N <= small_n_max``, ties to the smaller N)."""
    d = sel[sel["kind"].isin(["topn", "topn_nosink"]) & (sel["N"] >= small_n_min) & (sel["N"] <= small_n_max)]
    keys = ["window", "layer", "query", "head", "kind", "distance"]
    d = d.sort_values(keys + ["N"], kind="mergesort")
    m = d.loc[d.groupby(keys, sort=False)["F"].idxmax(), keys + ["N"]].rename(columns={"N": "best_n"})
    if not d["F_pred"].notna().any():
        return m.assign(best_n_pred=np.nan)
    p = d.loc[d.groupby(keys, sort=False)["F_pred"].idxmax(), keys + ["N"]].rename(columns={"N": "best_n_pred"})
    return m.merge(p, on=keys)


def summarize(sel: pd.DataFrame, reg: pd.DataFrame, violations: int, selections: int,
              small_n_max: int = 16) -> dict:
    """The ``summary.json`` content: F per N (means over windows, queries, layers and heads) for
    top-N and random, with and without the sink, both distances; predictions; regime parameters."""
    out: dict = {"bound_violations": int(violations), "selections_checked": int(selections)}
    if not len(sel):
        return out
    for dist in sorted(sel["distance"].unique()):
        dd = sel[sel["distance"] == dist]
        block = {}
        for label, suffix in (("with_sink", ""), ("without_sink", "_nosink")):
            top = dd[dd["kind"] == f"topn{suffix}"].groupby("N")
            rnd = dd[dd["kind"] == f"random{suffix}"].groupby("N")
            block[label] = {
                "f_topn": {int(n): float(x) for n, x in top["F"].mean().items()},
                "f_random": {int(n): float(x) for n, x in rnd["F"].mean().items()},
                "p_topn": {int(n): float(x) for n, x in top["P"].mean().items()},
                "r_topn": {int(n): float(x) for n, x in top["R"].mean().items()},
                "f_predicted": {int(n): float(x) for n, x in top["F_pred"].mean().items()},
                "ginv_topn": {int(n): float(x) for n, x in top["ginv"].mean().items()},
            }
        out[dist] = block
    if len(reg):
        def stat(col, fn="median"):
            x = reg[col].replace([np.inf, -np.inf], np.nan).dropna()
            return float(getattr(x, fn)()) if len(x) else None
        out["sink_regime"] = {
            "norm_ratio_median": stat("norm_ratio"),
            "norm_ratio_mean": stat("norm_ratio", "mean"),
            "norm_cv_median": stat("norm_cv"),
            "sink_cos_mean": stat("sink_cos", "mean"),
            "sink_cos_negative_share": float((reg["sink_cos"] < 0).mean()),
            "lambda_median": stat("lam"),
            "lambda_mae_mean": stat("lam_mae", "mean"),
            "cos_lag1_mean": stat("cos_lag1", "mean"),
            "cos_far_mean": stat("cos_far", "mean"),
            "sink_mass_mean": stat("sink_mass", "mean"),
            "middle_level_mean": stat("middle_level", "mean"),
            "recent_level_mean": stat("recent_level", "mean"),
            "recent_window_median": stat("recent_window"),
            "profile_r2_mean": stat("profile_r2", "mean"),
        }
        best = {}
        bt = best_small_n_table(sel, small_n_max=small_n_max)
        for (kind, dist), g in bt.dropna(subset=["best_n_pred"]).groupby(["kind", "distance"]):
            m, p = g["best_n"], g["best_n_pred"]
            best[f"{dist}_{'with_sink' if kind == 'topn' else 'without_sink'}"] = {
                "agreement": float((m == p).mean()),
                "measured_mode": int(m.mode().iloc[0]),
                "predicted_mode": int(p.mode().iloc[0]),
                "measured_share": {int(k): float(x) for k, x in m.value_counts(normalize=True).sort_index().items()},
                "predicted_share": {int(k): float(x) for k, x in p.value_counts(normalize=True).sort_index().items()},
            }
        out["best_small_n"] = {"small_n_min": 2, "small_n_max": small_n_max, **best}
    return out


# --------------------------------------------------------------------------------------------
# The corpus experiment
# --------------------------------------------------------------------------------------------


def experiment(handle: ModelHandleLike, run: RunLike, windows,
               settings: SelectionSettings = SelectionSettings()) -> ExperimentResult:
    """Selection geometry over ``windows`` as one stage (``selection``) of ``run`` (resumable,
    shareable), with ``settings`` (:class:`~attngeom.selection.settings.SelectionSettings`): each record is
    the :class:`SelectionStats` state of its windows. Returns an
    :class:`~attngeom.runs.contract.ExperimentResult` with ``tables["selection"]`` and
    ``tables["regime"]`` (rows per window: the ``window`` column is what a bootstrap over windows
    resamples) and ``summary`` (:func:`summarize`)."""
    from attngeom.streaming.stages import reduce_stage

    options = settings.stats_options()
    (reducer,) = reduce_stage(handle, run, "selection", windows, lambda: [SelectionStats(**options)],
                              layers=settings.layers, batch_size=settings.batch_size)
    sel, reg = reducer.result()
    if not len(sel):
        raise InputError("no query had at least 2 candidate sources; use longer windows")
    summary = summarize(sel, reg, reducer.violations, reducer.selections, reducer.small_n_max)
    return ExperimentResult("selection", tables={"selection": sel, "regime": reg}, summary=summary,
                            settings=settings.record())
