"""Attention sinks as active suppressors (SPEC §4): the pure math, per head in head space.

Every quantity is defined in SPEC §4 (docs/SPEC.md): the sink rate ``ρ_i``, the semantic part
``m_i``, anti-alignment, the counterfactual and its minimiser ``ρ*`` (:func:`rho_star`), the
decomposition by position class (levels and :func:`variance_shares`), semantic drift with its
cancellation and norm reduction.

How they are computed: per layer ``l``, head ``h`` and query ``i``, in head space through the Gram
matrix ``G = W_O^h W_O^hᵀ`` (SPEC §2), ``⟨ṽ_a, ṽ_b⟩ = v_aᵀ G v_b``, with the sink at position ``s``
(default 0) and ``u_i = Σ_j a_ij v_j`` the head output in head space. ``m_i`` is computed directly
as ``(a with the sink column zeroed) · v``, so there is no cancellation when ``ρ_i → 1``.

What belongs here: formulas on tensors and on summed statistics (histograms, least-squares fits).
Not here: the corpus reducer (:mod:`attngeom.sinks.reducer`), removal (:mod:`attngeom.sinks.removal`),
the experiment (:mod:`attngeom.sinks.experiment`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from attngeom.metrics import formulas as metrics

VANISHING = 1e-6
"""Below this a denominator counts as vanishing (relative to ``‖r‖² + ‖ṽ_0‖²`` for ρ*, absolute for
the rest ``1 − a_i0``): ρ* is then NaN, as every ρ gives the same output."""

# --------------------------------------------------------------------------------------------
# Pure math
# --------------------------------------------------------------------------------------------


def _dot(x: torch.Tensor, y: torch.Tensor, G: torch.Tensor | None = None) -> torch.Tensor:
    """``⟨x, y⟩`` over the last axis; in head space ``xᵀ G y`` when ``G`` is given.

    ``x, y [..., H, N, d]`` with ``G [H, d, d]``; without ``G`` any matching shapes."""
    if G is None:
        return (x * y).sum(-1)
    return ((x @ G) * y).sum(-1)


def rho_star_from_dots(r2: torch.Tensor, rv: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
    """``ρ* = (‖r‖² − ⟨r,ṽ_0⟩) / (‖r‖² − 2⟨r,ṽ_0⟩ + ‖ṽ_0‖²)`` from the three inner products;
    NaN where ``‖r − ṽ_0‖`` vanishes (every ρ gives the same output)."""
    den = r2 - 2 * rv + v2
    ok = den > VANISHING * (r2 + v2).clamp_min(1e-30)
    return torch.where(ok, (r2 - rv) / den, float("nan"))   # where() selects: the ratios at ~0 are never read


def rho_star(r: torch.Tensor, v0: torch.Tensor, G: torch.Tensor | None = None) -> torch.Tensor:
    """Exact minimiser over ρ of ``‖ρ ṽ_0 + (1−ρ) r‖``: ``ρ* = ⟨r, r − ṽ_0⟩ / ‖r − ṽ_0‖²`` (SPEC §4).

    ``r, v0 [..., d]`` in model space, or in head space with ``G`` (then ``[..., H, N, d]``)."""
    return rho_star_from_dots(_dot(r, r, G), _dot(r, v0, G), _dot(v0, v0, G))


def counterfactual_norm(r: torch.Tensor, v0: torch.Tensor, rho, G: torch.Tensor | None = None) -> torch.Tensor:
    """``‖o(ρ)‖ = ‖ρ ṽ_0 + (1−ρ) r‖`` (model space, or head space with ``G``)."""
    o = rho * v0 + (1 - rho) * r
    return _dot(o, o, G).clamp_min(0).sqrt()


def intra_dot(u: torch.Tensor, v: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``⟨o_i^h, ṽ_j^h⟩ = (u_i G)·v_j``: ``u [B,H,Q,d]``, ``v [B,H,S,d]`` -> ``[B,H,Q,S]``."""
    return (u @ G) @ v.transpose(-1, -2)


def sink_terms(a: torch.Tensor, v: torch.Tensor, G: torch.Tensor, v0: torch.Tensor,
               sink_col: int | None, visible: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-query sink quantities of one block, all ``[B, H, Q]``.

    ``a [B,H,Q,S]`` attention, ``v [B,H,S,d]`` values of the block's sources, ``G [H,d,d]``,
    ``v0 [B,H,d]`` the sink's value, ``sink_col`` its column in the block (None: not a source of
    the block, so ``ρ = 0``), ``visible [B|1,1,Q,S]`` (None: all). Keys: ``rho``, ``output_norm``
    ‖o_i‖, ``semantic_norm`` ‖m_i‖, ``sink_value_norm`` ‖ṽ_0‖, ``cos_v0_m``, ``sink_relative_norm``
    ‖ṽ_0‖/‖o_i‖, ``sink_cosine`` cos(o_i, ṽ_0), ``sink_contribution`` c_i0 (their product with ρ),
    ``rho_star``, ``tail_entropy`` (normalised, NaN with fewer than 2 non-sink sources),
    ``cancel``, ``norm_reduction``; plus ``m [B,H,Q,d]`` and ``u [B,H,Q,d]`` (head space)."""
    B, H, Q, S = a.shape
    a_tail = a
    if sink_col is not None:
        a_tail = a.clone()
        a_tail[..., sink_col] = 0.0
        rho = a[..., sink_col]
    else:
        rho = torch.zeros(B, H, Q, dtype=a.dtype, device=a.device)
    m = a_tail @ v                                            # [B,H,Q,d]
    u = m + rho.unsqueeze(-1) * v0.unsqueeze(2)               # = a @ v
    v0q = v0.unsqueeze(2)                                     # [B,H,1,d]
    n0sq = _dot(v0q, v0q, G).clamp_min(0)                     # [B,H,1]
    n0 = n0sq.sqrt().expand(B, H, Q)
    m2 = _dot(m, m, G).clamp_min(0)
    mn = m2.sqrt()
    d0m = ((v0q @ G) * m).sum(-1)                             # ⟨ṽ0, m⟩ [B,H,Q]
    d0u = d0m + rho * n0sq.expand(B, H, Q)                    # ⟨ṽ0, o⟩
    on = _dot(u, u, G).clamp_min(0).sqrt()
    s = 1.0 - rho
    ok = s > VANISHING
    s_safe = torch.where(ok, s, torch.ones_like(s))
    rs = rho_star_from_dots(m2 / s_safe**2, d0m / s_safe, n0sq.expand(B, H, Q))
    rs = torch.where(ok, rs, torch.full_like(rs, float("nan")))
    # normalised entropy of the renormalised non-sink attention
    p = metrics.safe_div(a_tail, s.unsqueeze(-1))
    ent = metrics.entropy(p)
    if visible is None:
        n_vis = torch.full((1, 1, Q), float(S - (sink_col is not None)), device=a.device)
    else:
        vis = visible.expand(-1, -1, Q, S).clone()
        if sink_col is not None:
            vis[..., sink_col] = False
        n_vis = vis.sum(-1).float()                           # [B|1,1,Q]
    logn = torch.log(n_vis.clamp_min(1.0)).expand(B, H, Q)
    tail_entropy = metrics.safe_div(ent, logn, fill=float("nan"))
    return {
        "rho": rho,
        "output_norm": on,
        "semantic_norm": mn,
        "sink_value_norm": n0,
        "cos_v0_m": metrics.safe_div(d0m, n0 * mn),
        "sink_relative_norm": metrics.safe_div(n0, on),
        "sink_cosine": metrics.safe_div(d0u, n0 * on),
        "sink_contribution": metrics.safe_div(rho * d0u, on * on),
        "rho_star": rs,
        "tail_entropy": tail_entropy,
        "cancel": metrics.safe_div(-rho * d0m, m2),
        "cancel_length": metrics.safe_div(-rho * d0m, mn),
        "norm_reduction": torch.where(mn > 0, 1.0 - metrics.safe_div(on, mn), torch.full_like(mn, float("nan"))),
        "m": m,
        "u": u,
    }


def pair_factors(a: torch.Tensor, u: torch.Tensor, v: torch.Tensor, G: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three factors of ``c_ij`` for every pair: ``attention``, ``relative_norm``, ``cosine``,
    and ``contribution`` (their product), each ``[B, H, Q, S]``."""
    f = metrics.contribution_factors(a, u, v, G)
    f["contribution"] = f["attention"] * f["relative_norm"] * f["cosine"]
    return f


def log_share_sums(factors: dict[str, torch.Tensor], mask: torch.Tensor, dims) -> dict[str, torch.Tensor]:
    """Sufficient statistics for the variance shares ``Cov(log f_k, log|c|)/Var(log|c|)``.

    Entries where any factor is 0 or not finite (no attention, no direction) are left out. Returns
    float64 sums over ``dims`` of ``n, y, y², x_k, x_k·y`` for ``k`` in attention, relative_norm,
    cosine (``x_k = log|f_k|``, ``y = Σ_k x_k``)."""
    keys = ("attention", "relative_norm", "cosine")
    ok = mask
    absx = {}
    for k in keys:
        x = factors[k].abs()
        ok = ok & (x > 0) & (x < float("inf"))
        absx[k] = x
    one = torch.ones((), dtype=factors["attention"].dtype, device=factors["attention"].device)
    logs = {k: torch.log(torch.where(ok, x, one)) for k, x in absx.items()}   # 0 where left out
    y = logs["attention"] + logs["relative_norm"] + logs["cosine"]
    f64 = torch.float64
    out = {"n": ok.sum(dims, dtype=f64), "y": y.sum(dims, dtype=f64), "yy": (y * y).sum(dims, dtype=f64)}
    for k, x in logs.items():
        out[f"x_{k}"] = x.sum(dims, dtype=f64)
        out[f"xy_{k}"] = (x * y).sum(dims, dtype=f64)
    return out


def variance_shares(s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Shares ``Cov(log f_k, y)/Var(y)`` from :func:`log_share_sums` (they sum to 1)."""
    n = np.maximum(s["n"], 1)
    ey = s["y"] / n
    var = s["yy"] / n - ey**2
    out = {}
    for k in ("attention", "relative_norm", "cosine"):
        cov = s[f"xy_{k}"] / n - (s[f"x_{k}"] / n) * ey
        out[k] = np.where(var > 0, cov / np.where(var > 0, var, 1), np.nan)
    return out


def histogram_counts(x: torch.Tensor, w: torch.Tensor, lo: float, hi: float, bins: int) -> torch.Tensor:
    """Per-head histogram: ``x, w [B, H, N]`` -> ``[H, bins + 2]`` float64 counts (first/last column:
    below ``lo`` / at or above ``hi``), on ``x``'s device. NaN entries are left out. ``w`` holds
    whole numbers (0/1 query weights): the counts are exact in any order of addition, so a GPU's
    ``index_add_`` gives the CPU's counts."""
    ok = torch.isfinite(x) & (w > 0)
    width = (hi - lo) / bins
    idx = torch.floor((torch.where(ok, x, torch.zeros_like(x)) - lo) / width).long()
    idx = idx.clamp(-1, bins) + 1                            # 0 = underflow, bins+1 = overflow
    wt = torch.where(ok, w, torch.zeros_like(w))
    return bin_sums(idx, bins + 2, wt[None])[0]


def bin_sums(bins: torch.Tensor, nb: int, weights: torch.Tensor) -> torch.Tensor:
    """Per head, the sum of each row of ``weights [V, B, H, N]`` over the entries in each of ``nb``
    bins (``bins [B, H, N]``, long, in ``[0, nb)``): ``[V, H, nb]`` float64 on their device, in one
    ``index_add_`` (on the CPU in the entries' order; on a GPU in the order the device schedules:
    whole-number weights give exact counts in any order, other sums vary in their last bits unless
    ``torch.use_deterministic_algorithms``)."""
    V = weights.shape[0]
    H = bins.shape[1]
    flat = (torch.arange(H, device=bins.device).view(1, H, 1) * nb + bins).reshape(-1)
    w = weights.double().reshape(V, -1)
    return w.new_zeros(V, H * nb).index_add_(1, flat, w).view(V, H, nb)


def histogram_quantile(counts: np.ndarray, lo: float, hi: float, q: float):
    """Quantile ``q`` of histograms from :func:`histogram_counts` (linear inside the bin; values in
    the under/overflow bins are reported as ``lo``/``hi``); NaN when empty. ``counts [..., bins + 2]``
    -> ``[...]`` (one histogram per leading index, e.g. per head and bootstrap resample); a single
    histogram ``[bins + 2]`` gives a float."""
    c = np.asarray(counts, dtype=np.float64)
    bins = c.shape[-1] - 2
    width = (hi - lo) / bins
    total = c.sum(-1)
    cum = np.cumsum(c, -1)
    target = q * total
    k = np.minimum((cum < target[..., None]).sum(-1), bins + 1)      # the first bin reaching the target
    below = np.take_along_axis(cum, np.maximum(k - 1, 0)[..., None], -1)[..., 0]
    ck = np.take_along_axis(c, k[..., None], -1)[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(ck > 0, (target - below) / np.where(ck > 0, ck, 1.0), 0.5)
    out = lo + (k - 1 + frac) * width
    out = np.where(k == 0, lo, np.where(k == bins + 1, hi, out))
    out = np.where(total > 0, out, np.nan)
    return float(out) if out.ndim == 0 else out


def quadratic_fit(sums: np.ndarray) -> dict[str, float]:
    """Least-squares fit ``‖o‖ ≈ α ρ² + β ρ + γ`` over the queries, from the sums
    ``[n, Σρ, Σρ², Σρ³, Σρ⁴, Σy, Σyρ, Σyρ², Σy²]``. Returns ``alpha, beta, gamma, vertex`` (the
    minimiser ``−β/2α`` when ``α > 0``, else NaN), ``r2`` and ``convex``."""
    n, s1, s2, s3, s4, y0, y1, y2, yy = [float(x) for x in sums]
    nan = float("nan")
    out = {"alpha": nan, "beta": nan, "gamma": nan, "vertex": nan, "r2": nan, "convex": False}
    if n < 3:
        return out
    A = np.array([[s4, s3, s2], [s3, s2, s1], [s2, s1, n]])
    b = np.array([y2, y1, y0])
    # relative conditioning: sink rates spread too little to fix a curvature
    var_rho = s2 / n - (s1 / n) ** 2
    if var_rho < 1e-8:
        return out
    try:
        coef = np.linalg.solve(A, b)
    except np.linalg.LinAlgError:
        return out
    al, be, ga = (float(c) for c in coef)
    sse = yy - 2 * coef @ b + coef @ A @ coef
    sst = yy - y0**2 / n
    out.update(alpha=al, beta=be, gamma=ga, r2=float(1 - sse / sst) if sst > 0 else nan, convex=al > 0)
    if al > 0:
        out["vertex"] = -be / (2 * al)
    return out


def quadratic_fit_shape(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whether the fits of :func:`quadratic_fit` are convex and have their vertex inside ``(0, 1)``,
    for many sums at once (every head, every bootstrap resample): ``sums [..., 9]`` -> ``(convex,
    vertex_interior)`` boolean ``[...]``. A fit counts only when it has at least 3 queries, sink rates
    that spread (variance ``>= 1e-8``, as in :func:`quadratic_fit`) and a well-conditioned system
    (``|det A| > 1e-15 · max|A|³``)."""
    s = np.asarray(sums, dtype=np.float64)
    n, s1, s2, s3, s4, y0, y1, y2 = (s[..., k] for k in range(8))
    A = np.stack([np.stack([s4, s3, s2], -1), np.stack([s3, s2, s1], -1), np.stack([s2, s1, n], -1)], -2)
    b = np.stack([y2, y1, y0], -1)
    with np.errstate(invalid="ignore", divide="ignore"):
        var_rho = s2 / np.where(n > 0, n, 1) - (s1 / np.where(n > 0, n, 1)) ** 2
        det = np.linalg.det(A)
        scale = np.abs(A).max((-1, -2)) ** 3
        ok = (n >= 3) & (var_rho >= 1e-8) & np.isfinite(det) & (np.abs(det) > 1e-300) & (np.abs(det) > 1e-15 * scale)
        eye = np.broadcast_to(np.eye(3), A.shape)
        coef = np.linalg.solve(np.where(ok[..., None, None], A, eye), np.where(ok[..., None], b, 0.0)[..., None])[..., 0]
        al, be = coef[..., 0], coef[..., 1]
        convex = ok & (al > 0)
        vertex = np.where(convex, -be / (2 * np.where(convex, al, 1.0)), np.nan)
    return convex, convex & (vertex > 0) & (vertex < 1)


def pearson(n, sx, sy, sxx, syy, sxy) -> float:
    if n < 2:
        return float("nan")
    cov = sxy / n - (sx / n) * (sy / n)
    vx = sxx / n - (sx / n) ** 2
    vy = syy / n - (sy / n) ** 2
    if vx <= 0 or vy <= 0:
        return float("nan")
    return float(cov / math.sqrt(vx * vy))
