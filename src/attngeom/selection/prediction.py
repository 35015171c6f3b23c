"""Geometry of token selection (SPEC §5): the sink-aware regime and the prediction of the curves from it.

The sink-aware regime, the prediction model and the best small ``N`` are defined in SPEC §5
(docs/SPEC.md): :func:`sink_regime` measures the value norms, the value cosines and their
``exp(−λ δ)`` fit and the three-piece attention profile at the query; :func:`predict_curves` turns
them into the model's Gram matrix and predicts ``P_N, R_N, F_N`` with the scoring code of
:mod:`attngeom.selection.separation`; :func:`best_small_n` picks the best small ``N``.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from attngeom.selection.settings import DISTANCES
from attngeom.selection.separation import geometry_from_rows, topn_order

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


@functools.lru_cache(maxsize=None)
def _grid_on(device: torch.device) -> torch.Tensor:
    """:data:`LAMBDA_GRID` on ``device``, copied there once."""
    return LAMBDA_GRID.to(device)


def fit_exp_decay(lags: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares ``λ`` of ``c(δ) ≈ exp(−λδ)`` for ``c [H, L]`` at ``lags [L]`` over a log grid
    (1e-4 .. 10^1.5, ~1 % steps), and the mean absolute error at that ``λ``: ``([H], [H])``."""
    grid = _grid_on(c.device)
    model = torch.exp(-grid[:, None] * lags[None, :].double())           # [grid, L]
    err = ((c.double()[:, None, :] - model[None]) ** 2).sum(-1)          # [H, grid]
    best = err.argmin(-1)
    lam = grid[best]
    mae = (c.double() - model[best]).abs().mean(-1)
    return lam, mae


def attention_profile(a: torch.Tensor, has_sink: bool = True, max_window: int | None = None) -> dict[str, torch.Tensor]:
    """Piecewise-constant fit of an attention row ``a [H, S]`` (sources in position order, the sink
    first when ``has_sink``): sink weight, middle level, recency level and recency window ``w``
    (``1 <= w <= n−1`` for ``n`` non-sink sources, minimising the squared error; ``w = n`` when
    ``n == 1``). Returns ``[H]`` tensors and ``profile_r2`` (1 − SSE/SST over the non-sink sources)."""
    H, S = a.shape
    a = a.double()
    sink = a[:, 0] if has_sink else a.new_zeros(H)
    b = a[:, 1:] if has_sink else a
    n = b.shape[1]
    if n <= 1:
        level = b.mean(-1) if n else a.new_zeros(H)
        return {"sink_mass": sink, "middle_level": a.new_zeros(H), "recent_level": level,
                "recent_window": torch.full((H,), n, device=a.device), "profile_r2": a.new_ones(H)}
    c1 = torch.cat([a.new_zeros(H, 1), b.cumsum(-1)], -1)                    # [H, n+1]
    c2 = torch.cat([a.new_zeros(H, 1), (b * b).cumsum(-1)], -1)
    wmax = n - 1 if max_window is None else max(1, min(n - 1, max_window))
    w = torch.arange(1, wmax + 1, device=a.device)
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
    out = unit.new_empty(H, len(lags))
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
    nan = torch.full((H,), float("nan"), dtype=torch.float64, device=v.device)
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
        lt = torch.tensor(lags, dtype=torch.float64, device=v.device)
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
    pos = torch.arange(n, device=w.device)
    recent = pos[None, :] >= (n - w)[:, None]                                 # [H, n]
    a_rest = torch.where(recent, params["recent_level"].to(dtype)[:, None], params["middle_level"].to(dtype)[:, None])
    if not has_sink:
        return a_rest, a_rest.clone()
    ratio = params["norm_ratio"].to(dtype)
    nu0 = torch.where(torch.isfinite(ratio) & (ratio > 0), 1 / ratio, torch.zeros_like(ratio))
    a_hat = torch.cat([params["sink_mass"].to(dtype)[:, None], a_rest], 1)     # [H, n+1]
    nu = torch.cat([nu0[:, None], nu0.new_ones(H, n)], 1)
    return a_hat, a_hat * nu


def model_rows(params: dict[str, torch.Tensor], scale: torch.Tensor, idx: torch.Tensor, has_sink: bool,
               drop_sink: bool = False) -> torch.Tensor:
    """Rows ``K[idx]`` of the model Gram matrix: ``scale [H, S]`` over the candidates, ``idx [H, r]``
    candidate indices -> ``[H, r, S]``. With ``has_sink`` index 0 is the sink (cosine ``κ`` with the
    others); ``drop_sink`` means the candidates are the non-sink sources only (positions 1..n)."""
    H, S = scale.shape
    lam = params["lam"].to(scale.dtype).nan_to_num(1.0)
    e = torch.exp(-lam[:, None] * torch.arange(S, dtype=scale.dtype, device=scale.device)[None, :])   # [H, S] by lag
    j = torch.arange(S, device=scale.device)
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
    idx = torch.arange(S, device=scale.device).expand(H, S)
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
        return torch.zeros(F.shape[0], dtype=torch.long, device=F.device)
    sub = F[:, keep]
    idx = sub.argmax(-1)  # first maximum
    return torch.as_tensor([ns[k] for k in keep], device=F.device)[idx]
