"""Attention sinks as active suppressors: pure math, a corpus reducer, and removal.

Every quantity is defined in SPEC §4 (docs/SPEC.md): the sink rate ``ρ_i``, the semantic part
``m_i``, the counterfactual and its minimiser ``ρ*`` (:func:`rho_star`), anti-alignment, the
decomposition by position class (levels and :func:`variance_shares`), semantic drift with its
cancellation and norm reduction (:class:`SinkDrift`), and sink-norm removal with its control and
the cone measure ``κ`` (:class:`SourceRemoval`).

How they are computed: per layer ``l``, head ``h`` and query ``i``, in head space through the Gram
matrix ``G = W_O^h W_O^hᵀ`` (SPEC §2), ``⟨ṽ_a, ṽ_b⟩ = v_aᵀ G v_b``, with the sink at position ``s``
(default 0) and ``u_i = Σ_j a_ij v_j`` the head output in head space. ``m_i`` is computed directly as
``(a with the sink column zeroed) · v``, so there is no cancellation when ``ρ_i → 1``. Corpus
distributions (cosines, ``ρ*``) are kept as histograms (:data:`HISTOGRAMS`) whose additive counts
merge across windows and processes; medians are read from them (:func:`histogram_quantile`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from attngeom.metrics import formulas as metrics
from attngeom.capture.plugin import Block
from attngeom.runs.contract import ExperimentResult, ModelHandleLike, RunLike, perplexity, window_records
from attngeom.capture.interventions import SOURCE_REMOVALS, remove_source
from attngeom.sinks.settings import SinksSettings
from attngeom.streaming.reducers import Batch, Reducer

# Histogram ranges (lo, hi, bins) per distribution; 0 (and 1 for ρ*) are bin edges, so the sign of
# a median read from the histogram (and whether it is inside (0, 1)) is exact.
HISTOGRAMS = {
    "cos_v0_m": (-1.0, 1.0, 200),
    "cos_v0_vj": (-1.0, 1.0, 200),
    "rho_star": (-4.0, 5.0, 900),
}
SINK_RATE_BINS = 20
ENTROPY_BINS = 10
EPS = 1e-6


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
    ok = den > EPS * (r2 + v2).clamp_min(1e-30)
    return torch.where(ok, (r2 - rv) / den, float("nan"))   # where() selects: the ratios at ~0 are never read


def rho_star(r: torch.Tensor, v0: torch.Tensor, G: torch.Tensor | None = None) -> torch.Tensor:
    """Exact minimiser over ρ of ``‖ρ ṽ_0 + (1−ρ) r‖``: ``ρ* = ⟨r, r − ṽ_0⟩ / ‖r − ṽ_0‖²`` (SPEC §4).

    ``r, v0 [..., d]`` in model space, or in head space with ``G`` (then ``[..., H, N, d]``)."""
    return rho_star_from_dots(_dot(r, r, G), _dot(r, v0, G), _dot(v0, v0, G))


def counterfactual_norm(r: torch.Tensor, v0: torch.Tensor, rho, G: torch.Tensor | None = None) -> torch.Tensor:
    """``‖o(ρ)‖ = ‖ρ ṽ_0 + (1−ρ) r‖`` (model space, or head space with ``G``)."""
    o = rho * v0 + (1 - rho) * r
    return _dot(o, o, G).clamp_min(0).sqrt()


def _intra_dot(u: torch.Tensor, v: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
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
    ok = s > EPS
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
    below ``lo`` / at or above ``hi``). NaN entries are left out."""
    H = x.shape[1]
    ok = torch.isfinite(x) & (w > 0)
    width = (hi - lo) / bins
    idx = torch.floor((torch.where(ok, x, torch.zeros_like(x)) - lo) / width).long()
    idx = idx.clamp(-1, bins) + 1                            # 0 = underflow, bins+1 = overflow
    head = torch.arange(H, device=x.device).view(1, H, 1).expand_as(idx)
    flat = (head * (bins + 2) + idx).reshape(-1)
    wt = torch.where(ok, w, torch.zeros_like(w)).reshape(-1).double()
    return torch.bincount(flat.cpu(), weights=wt.cpu(), minlength=H * (bins + 2)).view(H, bins + 2)


def histogram_quantile(counts: np.ndarray, lo: float, hi: float, q: float) -> float:
    """Quantile ``q`` of a histogram from :func:`histogram_counts` (linear inside the bin; values in
    the under/overflow bins are reported as ``lo``/``hi``); NaN when empty."""
    counts = np.asarray(counts, dtype=float)
    total = counts.sum()
    if total <= 0:
        return float("nan")
    bins = len(counts) - 2
    width = (hi - lo) / bins
    cum = np.cumsum(counts)
    target = q * total
    k = int(np.searchsorted(cum, target, side="left"))
    if k == 0:
        return lo
    if k == bins + 1:
        return hi
    below = cum[k - 1]
    frac = (target - below) / counts[k] if counts[k] > 0 else 0.5
    return lo + (k - 1 + frac) * width


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


def _pearson(n, sx, sy, sxx, syy, sxy) -> float:
    if n < 2:
        return float("nan")
    cov = sxy / n - (sx / n) * (sy / n)
    vx = sxx / n - (sx / n) ** 2
    vy = syy / n - (sy / n) ** 2
    if vx <= 0 or vy <= 0:
        return float("nan")
    return float(cov / math.sqrt(vx * vy))


# --------------------------------------------------------------------------------------------
# The corpus reducer
# --------------------------------------------------------------------------------------------

_MEANS = ("rho", "sink_contribution", "sink_contribution_inter", "output_norm", "semantic_norm",
          "sink_value_norm", "cos_v0_m", "sink_relative_norm", "sink_cosine", "cancel_length", "tail_entropy")


class _SinkPart(Reducer):
    """One focused part of the sink statistics. Queries counted: real tokens at positions
    ``i > sink`` of the ``layers`` reduced (None: every observed layer). The parts share the sink
    terms of each block (:func:`block_terms`, computed once per block whatever the parts)."""

    STATE = ("acc",)

    def __init__(self, sink: int = 0, layers=None):
        self.sink = int(sink)
        self.layers = None if layers is None else set(int(x) for x in layers)
        self.acc: dict[int, dict[str, torch.Tensor]] = {}

    def _add(self, layer: int, key: str, x: torch.Tensor) -> None:
        x = x.detach().double().cpu()
        d = self.acc.setdefault(layer, {})
        if key not in d:
            d[key] = torch.zeros(x.shape, dtype=torch.float64)
        d[key].add_(x)

    def _binned(self, layer: int, name: str, bins: torch.Tensor, nb: int, w: torch.Tensor,
                values: dict[str, torch.Tensor]) -> None:
        """Per head, sums and counts of ``values`` over the queries in each of ``nb`` bins."""
        B, H, Q = bins.shape
        head = torch.arange(H).view(1, H, 1).expand(B, H, Q)
        flat = (head * nb + bins.cpu()).reshape(-1)
        wc = w.cpu().reshape(-1)
        self._add(layer, f"{name}_n", torch.bincount(flat, weights=wc, minlength=H * nb).view(H, nb))
        for k, x in values.items():
            x = x.cpu()
            ok = torch.isfinite(x).reshape(-1) & (wc > 0)
            xv = torch.where(ok, x.reshape(-1), torch.zeros_like(wc)) * wc
            self._add(layer, f"{name}_{k}_n", torch.bincount(flat, weights=ok.double() * wc, minlength=H * nb).view(H, nb))
            self._add(layer, f"{name}_{k}_sum", torch.bincount(flat, weights=xv, minlength=H * nb).view(H, nb))
            if k == "output_norm":
                self._add(layer, f"{name}_{k}_sq", torch.bincount(flat, weights=xv * x.reshape(-1).nan_to_num(),
                                                                  minlength=H * nb).view(H, nb))

    def observe(self, block: Block) -> None:
        if self.layers is not None and block.layer not in self.layers:
            return
        if self.sink >= block.state.num_sources:
            return
        t = block_terms(block, self.sink)
        if t is not None:
            self.add_terms(block, t)

    def add_terms(self, block: Block, t: dict) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def head_columns(self, A: dict[str, np.ndarray], h: int) -> dict:
        """Columns of head ``h``'s row from this part's sums ``A`` of one layer."""
        return {}

    def head_tables(self, layer: int, A: dict[str, np.ndarray], h: int) -> dict[str, list[dict]]:
        """Rows of the other tables (``curve``, ``drift``, ``hist``) for head ``h``."""
        return {}


def block_terms(block: Block, sink: int) -> dict | None:
    """The per-query sink terms of ``block`` (:func:`sink_terms` plus the query weights and the
    inter-head sink contribution), computed once per block and sink position and kept on the block
    for every part that asks. None when the block has no query after the sink."""
    memo = block.__dict__.setdefault("_sink_terms", {})
    if sink in memo:
        return memo[sink]
    B, H, Q, S = block.shape
    st = block.state
    qw = (block.query_valid & (block.q_positions[None, :] > sink)).float()   # [B,Q]
    if qw.sum() == 0:
        memo[sink] = None
        return None
    sink_col = sink - block.k_start
    sink_col = sink_col if 0 <= sink_col < S else None
    v0 = st.v[:, :, sink]
    t = sink_terms(block.a, block.v, st.G, v0, sink_col, block.visible)
    # inter-head sink contribution C_i0^h = ρ ⟨o_i, ṽ_0^h⟩ / ‖o_i‖²
    t["sink_contribution_inter"] = metrics.safe_div(t["rho"] * (block.pulled_back * v0.unsqueeze(2)).sum(-1),
                                             block.output_sq[:, None, :])
    w = qw[:, None, :].expand(B, H, Q)                                       # [B,H,Q]
    t.update(qw=qw, w=w, wd=w.double(), sink_col=sink_col)
    memo[sink] = t
    return t


class SinkValues(_SinkPart):
    """Once per text and layer: the sink's value norm against the other sources' (projected and
    raw), and the histogram and mean of ``cos(ṽ_0, ṽ_j)`` over the text's sources ``j ≠ sink``."""

    def begin(self, batch: Batch) -> None:
        super().begin(batch)
        self._seen: set[int] = set()

    def observe(self, block: Block) -> None:
        if self.layers is not None and block.layer not in self.layers:
            return
        if self.sink >= block.state.num_sources or block.layer in self._seen:
            return
        self._seen.add(block.layer)
        st = block.state
        v = st.v                                                   # [B,H,T,d]
        B, H, T, _ = v.shape
        pos = torch.arange(T, device=v.device)
        src = (pos[None, :] < st.lengths[:, None]) & (pos[None, :] != self.sink)  # [B,T]
        has_sink = (st.lengths > self.sink).double()                              # [B]
        w = src.double()[:, None, :].expand(B, H, T)
        vn = st.value_norm.double()
        rn = st.raw_value_norm.double()
        layer = block.layer
        self._add(layer, "n_texts", has_sink.sum().expand(H).clone())
        self._add(layer, "v0_norm_sum", (vn[:, :, self.sink] * has_sink[:, None]).sum(0))
        self._add(layer, "v0_raw_norm_sum", (rn[:, :, self.sink] * has_sink[:, None]).sum(0))
        wt = w * has_sink[:, None, None]
        self._add(layer, "n_sources", wt.sum((0, 2)))
        self._add(layer, "vj_norm_sum", (vn * wt).sum((0, 2)))
        self._add(layer, "vj_raw_norm_sum", (rn * wt).sum((0, 2)))
        v0 = v[:, :, self.sink]                                    # [B,H,d]
        dots = ((v0.unsqueeze(2) @ st.G) * v).sum(-1)              # [B,H,T]
        cos = metrics.safe_div(dots, st.value_norm[:, :, self.sink:self.sink + 1] * st.value_norm)
        lo, hi, bins = HISTOGRAMS["cos_v0_vj"]
        self._add(layer, "hist_cos_v0_vj", histogram_counts(cos, wt.float(), lo, hi, bins))
        self._add(layer, "cos_v0_vj_sum", (cos.double() * wt).sum((0, 2)))

    def head_columns(self, A, h) -> dict:
        nt, ns = A["n_texts"][h], A["n_sources"][h]
        row = {
            "value_norm_ratio": _ratio_of_means(A["vj_norm_sum"][h], ns, A["v0_norm_sum"][h], nt),
            "raw_value_norm_ratio": _ratio_of_means(A["vj_raw_norm_sum"][h], ns, A["v0_raw_norm_sum"][h], nt),
            "cos_v0_vj": A["cos_v0_vj_sum"][h] / ns if ns else np.nan,
        }
        row.update(_quantiles("cos_v0_vj", A["hist_cos_v0_vj"][h]))
        return row

    def head_tables(self, layer, A, h) -> dict[str, list[dict]]:
        return {"hist": _hist_rows(layer, h, "cos_v0_vj", A["hist_cos_v0_vj"][h])}


def _ratio_of_means(num_sum, num_n, den_sum, den_n) -> float:
    """``(num_sum / num_n) / (den_sum / den_n)``: NaN without samples on either side; a sink whose
    value is exactly zero (some heads of ZAYA) gives ``inf`` (no warning), or NaN when both are zero."""
    if not (num_n and den_n):
        return np.nan
    num, den = float(num_sum) / float(num_n), float(den_sum) / float(den_n)
    if den == 0.0:
        return np.inf if num > 0 else np.nan
    return num / den


class SinkQueries(_SinkPart):
    """Per query ``i > sink``: the means of the sink terms (sink rate, contributions, norms,
    anti-alignment ``cos(ṽ_0, m_i)``, ...), ``ρ*`` and its interior share, the histograms of
    ``cos(ṽ_0, m_i)`` and ``ρ*``, and the convexity of the output norm in the sink rate: exact
    least-squares sums of the quadratic fit and the sink-rate bins (``curve``)."""

    def add_terms(self, block: Block, t: dict) -> None:
        layer, w, wd = block.layer, t["w"], t["wd"]
        self._add(layer, "n", wd.sum((0, 2)))
        for k in _MEANS:
            x = t[k].double()
            ok = torch.isfinite(x)
            self._add(layer, f"sum_{k}", torch.where(ok, x * wd, torch.zeros_like(x)).sum((0, 2)))
            self._add(layer, f"n_{k}", (ok.double() * wd).sum((0, 2)))
        rs = t["rho_star"].double()
        ok = torch.isfinite(rs) & (wd > 0)
        self._add(layer, "n_rho_star", ok.double().sum((0, 2)))
        self._add(layer, "rho_star_interior", ((rs > 0) & (rs < 1) & ok).double().sum((0, 2)))
        for name in ("cos_v0_m", "rho_star"):
            lo, hi, bins = HISTOGRAMS[name]
            self._add(layer, f"hist_{name}", histogram_counts(t[name], w, lo, hi, bins))
        self._add(layer, "sink_negative", ((t["sink_contribution"] < 0).double() * wd).sum((0, 2)))
        rho, y = t["rho"].double(), t["output_norm"].double()
        pw = [wd * rho**k for k in range(5)]
        fit = torch.stack([p.sum((0, 2)) for p in pw]
                          + [(y * pw[k]).sum((0, 2)) for k in range(3)] + [(y * y * wd).sum((0, 2))], -1)
        self._add(layer, "fit", fit)                                # [H, 9]
        rbin = (rho * SINK_RATE_BINS).floor().clamp(0, SINK_RATE_BINS - 1).long()
        self._binned(layer, "curve", rbin, SINK_RATE_BINS, wd,
                     {"output_norm": y, "semantic_norm": t["semantic_norm"].double(),
                      "tail_entropy": t["tail_entropy"].double(), "cancel_length": t["cancel_length"].double()})

    def head_columns(self, A, h) -> dict:
        n = A["n"][h]
        row = {"queries": int(n)}
        for k in _MEANS:
            cnt = A[f"n_{k}"][h]
            row[k if k != "rho" else "sink_rate"] = A[f"sum_{k}"][h] / cnt if cnt else np.nan
        row["cancel"] = _ratio(A["sum_cancel_length"][h], A["sum_semantic_norm"][h])
        row["norm_reduction"] = 1.0 - _ratio(A["sum_output_norm"][h], A["sum_semantic_norm"][h])
        row["sink_negative_share"] = A["sink_negative"][h] / n if n else np.nan
        for name in ("cos_v0_m", "rho_star"):
            row.update(_quantiles(name, A[f"hist_{name}"][h]))
        row["anti_aligned"] = bool(row["cos_v0_m_median"] < 0)
        nrs = A["n_rho_star"][h]
        row["rho_star_interior_share"] = A["rho_star_interior"][h] / nrs if nrs else np.nan
        row["rho_star_median_interior"] = bool(0 < row["rho_star_median"] < 1)
        fit = quadratic_fit(A["fit"][h])
        row.update({f"fit_{k}": v for k, v in fit.items()})
        row["fit_vertex_interior"] = bool(fit["convex"] and 0 < fit["vertex"] < 1)
        row["rho_min"], row["rho_max"] = _bin_range(A["curve_n"][h])
        return row

    def head_tables(self, layer, A, h) -> dict[str, list[dict]]:
        curve = []
        for b in range(SINK_RATE_BINS):
            r = {"layer": layer, "head": h, "bin_lo": b / SINK_RATE_BINS, "bin_hi": (b + 1) / SINK_RATE_BINS,
                 "queries": int(A["curve_n"][h, b])}
            for k in ("output_norm", "semantic_norm", "tail_entropy", "cancel_length"):
                c = A[f"curve_{k}_n"][h, b]
                r[k] = A[f"curve_{k}_sum"][h, b] / c if c else np.nan
            r["cancel"] = _ratio(A["curve_cancel_length_sum"][h, b], A["curve_semantic_norm_sum"][h, b])
            r["norm_reduction"] = 1.0 - _ratio(A["curve_output_norm_sum"][h, b], A["curve_semantic_norm_sum"][h, b])
            c = A["curve_output_norm_n"][h, b]
            r["output_norm_std"] = (np.sqrt(max(A["curve_output_norm_sq"][h, b] / c - r["output_norm"] ** 2, 0))
                                    if c else np.nan)
            curve.append(r)
        hist = [row for name in ("cos_v0_m", "rho_star") for row in _hist_rows(layer, h, name, A[f"hist_{name}"][h])]
        return {"curve": curve, "hist": hist}


class SinkDrift(_SinkPart):
    """Semantic drift: queries binned by the normalised entropy of their non-sink attention (sink
    rate, cancellation and norms per bin), and the correlation of the sink rate with that entropy."""

    def add_terms(self, block: Block, t: dict) -> None:
        layer, wd = block.layer, t["wd"]
        rho, y = t["rho"].double(), t["output_norm"].double()
        te = t["tail_entropy"].double()
        okd = torch.isfinite(te) & (wd > 0)
        ebin = (torch.where(okd, te, torch.zeros_like(te)) * ENTROPY_BINS).floor().clamp(0, ENTROPY_BINS - 1).long()
        self._binned(layer, "drift", ebin, ENTROPY_BINS, okd.double(),
                     {"rho": rho, "cancel_length": t["cancel_length"].double(),
                      "semantic_norm": t["semantic_norm"].double(), "output_norm": y})
        te0 = torch.where(okd, te, torch.zeros_like(te))
        dw = okd.double()
        self._add(layer, "corr_rho_entropy", torch.stack([
            dw.sum((0, 2)), (rho * dw).sum((0, 2)), (te0 * dw).sum((0, 2)), (rho * rho * dw).sum((0, 2)),
            (te0 * te0 * dw).sum((0, 2)), (rho * te0 * dw).sum((0, 2))], -1))

    def head_columns(self, A, h) -> dict:
        return {"corr_rho_entropy": _pearson(*A["corr_rho_entropy"][h])}

    def head_tables(self, layer, A, h) -> dict[str, list[dict]]:
        drift = []
        for b in range(ENTROPY_BINS):
            r = {"layer": layer, "head": h, "bin_lo": b / ENTROPY_BINS, "bin_hi": (b + 1) / ENTROPY_BINS,
                 "queries": int(A["drift_n"][h, b])}
            for k in ("rho", "semantic_norm", "output_norm"):
                c = A[f"drift_{k}_n"][h, b]
                r[k if k != "rho" else "sink_rate"] = A[f"drift_{k}_sum"][h, b] / c if c else np.nan
            r["cancel"] = _ratio(A["drift_cancel_length_sum"][h, b], A["drift_semantic_norm_sum"][h, b])
            r["norm_reduction"] = 1.0 - _ratio(A["drift_output_norm_sum"][h, b], A["drift_semantic_norm_sum"][h, b])
            drift.append(r)
        return {"drift": drift}


class SinkDecomposition(_SinkPart):
    """The factor decomposition ``c = attention · relative norm · cosine`` for the sink (per query)
    and the tail (per visible (query, source ≠ sink) pair): factor levels and variance shares."""

    def add_terms(self, block: Block, t: dict) -> None:
        layer, w, qw, sink_col = block.layer, t["w"], t["qw"], t["sink_col"]
        B, H, Q, S = block.shape
        sink_f = {"attention": t["rho"], "relative_norm": t["sink_relative_norm"], "cosine": t["sink_cosine"]}
        for k, x in log_share_sums(sink_f, w > 0, (0, 2)).items():
            self._add(layer, f"sinklog_{k}", x)
        f = pair_factors(block.a, t["u"], block.v, block.state.G)
        pair = block.visible.expand(B, 1, Q, S) & (qw[:, None, :, None] > 0)
        if sink_col is not None:
            pair = pair.clone()
            pair[..., sink_col] = False
        pair = pair.expand(B, H, Q, S)
        f64 = torch.float64
        zero = torch.zeros((), dtype=block.a.dtype, device=block.a.device)
        self._add(layer, "n_pairs", pair.sum((0, 2, 3), dtype=f64))
        for k in ("attention", "relative_norm", "cosine", "contribution"):
            self._add(layer, f"tail_{k}_sum", torch.where(pair, f[k], zero).sum((0, 2, 3), dtype=f64))
        self._add(layer, "tail_negative", (pair & (f["contribution"] < 0)).sum((0, 2, 3), dtype=f64))
        for k, x in log_share_sums(f, pair, (0, 2, 3)).items():
            self._add(layer, f"taillog_{k}", x)

    def head_columns(self, A, h) -> dict:
        share_sink = variance_shares({k[len("sinklog_"):]: x for k, x in A.items() if k.startswith("sinklog_")})
        share_tail = variance_shares({k[len("taillog_"):]: x for k, x in A.items() if k.startswith("taillog_")})
        row = {f"sink_share_{k}": share_sink[k][h] for k in ("attention", "relative_norm", "cosine")}
        np_ = A["n_pairs"][h]
        for k in ("attention", "relative_norm", "cosine", "contribution"):
            row[f"tail_{k}"] = A[f"tail_{k}_sum"][h] / np_ if np_ else np.nan
        for k in ("attention", "relative_norm", "cosine"):
            row[f"tail_share_{k}"] = share_tail[k][h]
        row["tail_negative_share"] = A["tail_negative"][h] / np_ if np_ else np.nan
        row["tail_pairs"] = int(np_)
        return row


class SinkStats(Reducer):
    """Per (layer, head) sink statistics over a corpus (see the module docstring for definitions):
    the four focused parts :class:`SinkValues`, :class:`SinkQueries`, :class:`SinkDrift` and
    :class:`SinkDecomposition` together, one row per head.

    Queries counted: real tokens at positions ``i > sink``. ``layers``: the layers to reduce (None:
    every observed layer). :meth:`result` returns a dict of DataFrames: ``heads`` (one row per
    layer and head), ``curve`` (queries binned by sink rate), ``drift`` (queries binned by the
    normalised non-sink entropy) and ``hist`` (histograms of ``cos_v0_m``, ``cos_v0_vj``,
    ``rho_star``)."""

    PARTS = (SinkValues, SinkQueries, SinkDrift, SinkDecomposition)

    def __init__(self, sink: int = 0, layers=None):
        self.sink = int(sink)
        self.parts = [P(sink, layers) for P in self.PARTS]

    def state(self) -> dict:
        return {type(p).__name__: p.state() for p in self.parts}

    def load_state(self, state: dict) -> "SinkStats":
        for p in self.parts:
            p.load_state(state[type(p).__name__])
        return self

    def begin(self, batch: Batch) -> None:
        super().begin(batch)
        for p in self.parts:
            p.begin(batch)

    def observe(self, block: Block) -> None:
        for p in self.parts:
            p.observe(block)

    def result(self) -> dict[str, pd.DataFrame]:
        tables: dict[str, list[dict]] = {"heads": [], "curve": [], "drift": [], "hist": []}
        queries = self.parts[1]
        for layer in sorted(queries.acc):
            A = [{k: x.numpy() for k, x in p.acc.get(layer, {}).items()} for p in self.parts]
            if "n" not in A[1]:
                continue
            for h in range(len(A[1]["n"])):
                row = {"layer": layer, "head": h}
                for p, a in zip(self.parts, A):
                    if a:
                        row.update(p.head_columns(a, h))
                for k in ("attention", "relative_norm", "cosine"):
                    row[f"sink_{k}"] = {"attention": row["sink_rate"], "relative_norm": row["sink_relative_norm"],
                                        "cosine": row["sink_cosine"]}[k]
                tables["heads"].append(row)
                for p, a in zip(self.parts, A):
                    if a:
                        for name, rows in p.head_tables(layer, a, h).items():
                            tables[name] += rows
        cols_h = ["layer", "head", "quantity", "bin_lo", "bin_hi", "count"]
        hist = pd.DataFrame(tables["hist"], columns=cols_h)
        if len(hist):  # one order whatever part a histogram comes from
            order = {q: i for i, q in enumerate(HISTOGRAMS)}
            hist = hist.iloc[np.lexsort((hist["quantity"].map(order).to_numpy(), hist["head"].to_numpy(),
                                         hist["layer"].to_numpy()))].reset_index(drop=True)
        return {"heads": pd.DataFrame(tables["heads"]), "curve": pd.DataFrame(tables["curve"]),
                "drift": pd.DataFrame(tables["drift"]), "hist": hist}


def _quantiles(name: str, counts: np.ndarray) -> dict:
    lo, hi, bins = HISTOGRAMS[name]
    return {f"{name}_{lab}": histogram_quantile(counts, lo, hi, q)
            for q, lab in ((0.1, "q10"), (0.25, "q25"), (0.5, "median"), (0.75, "q75"), (0.9, "q90"))}


def _hist_rows(layer: int, h: int, name: str, c: np.ndarray) -> list[dict]:
    lo, hi, bins = HISTOGRAMS[name]
    width = (hi - lo) / bins
    edges_lo = np.concatenate([[-np.inf], lo + width * np.arange(bins), [hi]])
    edges_hi = np.concatenate([[lo], lo + width * np.arange(1, bins + 1), [np.inf]])
    return [{"layer": layer, "head": h, "quantity": name, "bin_lo": edges_lo[b], "bin_hi": edges_hi[b],
             "count": float(c[b])} for b in np.nonzero(c)[0]]


def _ratio(x: float, y: float) -> float:
    return float(x / y) if y else float("nan")


def _bin_range(counts: np.ndarray) -> tuple[float, float]:
    nz = np.nonzero(counts)[0]
    if len(nz) == 0:
        return float("nan"), float("nan")
    return nz[0] / SINK_RATE_BINS, (nz[-1] + 1) / SINK_RATE_BINS


# --------------------------------------------------------------------------------------------
# Removal
# --------------------------------------------------------------------------------------------

REMOVAL_MODES = ("none", *SOURCE_REMOVALS)


class SourceRemoval(Reducer):
    """Intervention that removes the sink (``mode="sink"``) or the mass-matched control source
    (``mode="control"``) from every query ``i > sink`` of ``layers`` (None: all observed layers), and
    records, for every observed layer, the head outputs that are actually used.

    With ``mode="none"`` nothing is edited: the same statistics describe the unedited model, so a
    baseline pass and a removal pass are measured by the same code. ``min_query`` (default
    ``sink + 1``) is the first query position edited. Queries whose sink rate (in the pass's own,
    unedited attention) is at least ``heavy`` are also summarised apart (``*_sink_heavy``): these
    are the low-norm outputs the paper says collapse into the semantic cone."""

    def __init__(self, mode: str = "sink", sink: int = 0, layers=None, min_query: int | None = None,
                 heavy: float = 0.5):
        if mode not in REMOVAL_MODES:
            raise ValueError(f"mode must be one of {REMOVAL_MODES}, got {mode!r}")
        self.mode = mode
        self.sink = int(sink)
        self.layers = None if layers is None else set(int(x) for x in layers)
        self.min_query = self.sink + 1 if min_query is None else int(min_query)
        self.heavy = float(heavy)
        self.acc: dict[int, dict[str, torch.Tensor]] = {}
        self.calls = 0

    STATE = ("acc", "calls")

    def edits(self, layer: int) -> bool:
        return self.mode != "none" and (self.layers is None or layer in self.layers)

    def _add(self, layer: int, key: str, x: torch.Tensor) -> None:
        d = self.acc.setdefault(layer, {})
        x = x.detach().double().cpu()
        if key not in d:
            d[key] = torch.zeros_like(x)
        d[key] += x

    def __call__(self, block: Block) -> torch.Tensor | None:
        self.calls += 1
        B, H, Q, S = block.shape
        a = block.a
        st = block.state
        sink_col = self.sink - block.k_start
        sink_col = sink_col if 0 <= sink_col < S else None
        qsel = block.query_valid & (block.q_positions[None, :] >= self.min_query)       # [B,Q]
        edited = None
        removed = torch.zeros(B, H, Q, device=a.device)
        if self.edits(block.layer):
            edited, removed = remove_source(a, block.visible, sink_col, qsel, self.mode, removed)
        # statistics of the outputs actually used (queries i > sink)
        w = (block.query_valid & (block.q_positions[None, :] > self.sink)).double()     # [B,Q]
        if w.sum() > 0:
            mix = a if edited is None else edited
            G = st.G
            u = mix @ block.v                                                        # [B,H,Q,d]
            on = metrics.head_output_norm(u, G)
            a_tail = a.clone()
            if sink_col is not None:
                a_tail[..., sink_col] = 0.0
            m = a_tail @ block.v
            mn = metrics.head_output_norm(m, G)
            cos_om = metrics.safe_div(((u @ G) * m).sum(-1), on * mn)
            # cone measure κ: attention-weighted mean cosine of o with the non-sink values
            dots = _intra_dot(u, block.v, G)                                         # [B,H,Q,S]
            vn = block.value_norm.unsqueeze(-2)
            cos = metrics.safe_div(dots, on.unsqueeze(-1) * vn)
            kappa = metrics.safe_div((a_tail * cos).sum(-1), a_tail.sum(-1))
            o_norm = (metrics.pulled_back(u, st.G_full) * u).sum((1, -1)).clamp_min(0).sqrt()  # ‖o_i‖ [B,Q]
            wd = w[:, None, :].expand(B, H, Q)
            L = block.layer
            self._add(L, "n", wd.sum((0, 2)))
            self._add(L, "output_norm", (on.double() * wd).sum((0, 2)))
            self._add(L, "log_output_norm", (torch.log(on.double().clamp_min(1e-30)) * wd).sum((0, 2)))
            self._add(L, "cone", (kappa.double() * wd).sum((0, 2)))
            self._add(L, "cos_output_semantic", (cos_om.double() * wd).sum((0, 2)))
            self._add(L, "removed_mass", (removed.double() * wd).sum((0, 2)))
            rho = a[..., sink_col] if sink_col is not None else torch.zeros_like(on)
            heavy = wd * (rho >= self.heavy).double()
            self._add(L, "heavy_n", heavy.sum((0, 2)))
            self._add(L, "heavy_output_norm", (on.double() * heavy).sum((0, 2)))
            self._add(L, "heavy_cone", (kappa.double() * heavy).sum((0, 2)))
            self._add(L, "layer_n", w.sum().reshape(1))
            self._add(L, "layer_output_norm", (o_norm.double() * w).sum().reshape(1))
        return edited

    def result(self) -> pd.DataFrame:
        """One row per (layer, head): mean ``output_norm``, ``log_output_norm``, ``cone``,
        ``cos_output_semantic``, ``removed_mass``, the same means of ``output_norm`` and ``cone``
        over sink-heavy queries (``*_sink_heavy``, with their count), and the layer's mean
        ``layer_output_norm``."""
        rows = []
        for layer in sorted(self.acc):
            A = {k: x.numpy() for k, x in self.acc[layer].items()}
            H = len(A["n"])
            lo = A["layer_output_norm"][0] / A["layer_n"][0] if A["layer_n"][0] else np.nan
            for h in range(H):
                n = A["n"][h]
                row = {"mode": self.mode, "layer": layer, "head": h, "queries": int(n),
                       "edited": self.edits(layer)}
                for k in ("output_norm", "log_output_norm", "cone", "cos_output_semantic", "removed_mass"):
                    row[k] = A[k][h] / n if n else np.nan
                hn = A["heavy_n"][h]
                row["queries_sink_heavy"] = int(hn)
                row["output_norm_sink_heavy"] = A["heavy_output_norm"][h] / hn if hn else np.nan
                row["cone_sink_heavy"] = A["heavy_cone"][h] / hn if hn else np.nan
                row["layer_output_norm"] = lo
                rows.append(row)
        return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# The corpus experiment
# --------------------------------------------------------------------------------------------

PASSES = ("none", "sink", "control")
PASS_SUFFIX = {"none": "base", "sink": "removed", "control": "control"}


def window_work(handle: ModelHandleLike, windows, *, sink: int = 0, layers=None, removal_layers=None,
                batch_size: int = 2):
    """The per-unit work of the sinks experiment: ``work(units) -> record``.

    For the windows ``units``, three passes: the unedited model with :class:`SinkStats` (and the
    baseline :class:`SourceRemoval` statistics), sink removal and the control removal at
    ``removal_layers``. The record holds the reducers' additive states and the summed NLL and token
    count of each pass."""
    from attngeom.capture.plugin import Session
    from attngeom.streaming.passes import batch_nll, make_batches, scored_tokens

    session_layers = None
    if layers is not None and removal_layers is not None:
        session_layers = sorted(set(layers) | set(removal_layers))

    def work(units: list[int]) -> dict:
        stats = SinkStats(sink=sink, layers=layers)
        rec = {"nll": {}, "tokens": 0, "removal": {}}
        for mode in PASSES:
            removal = SourceRemoval(mode, sink=sink, layers=removal_layers)
            session = Session(observers=[stats] if mode == "none" else [], intervention=removal,
                              layers=session_layers)
            nll = 0.0
            for batch in make_batches(handle, [windows[u] for u in units], batch_size, index=units):
                if mode == "none":
                    stats.begin(batch)
                nll += float(batch_nll(handle, batch, session).sum())
                if mode == "none":
                    stats.end(batch)
                    rec["tokens"] += scored_tokens(batch)
            rec["nll"][mode] = nll
            rec["removal"][mode] = removal.state()
        rec["stats"] = stats.state()
        return rec

    return work


def results_from(merged: dict, *, sink: int = 0, layers=None, removal_layers=None) -> dict[str, pd.DataFrame]:
    """Tables of the experiment from the merged records: ``heads`` (SinkStats heads with the
    removal effects as ``*_base``/``*_removed``/``*_control`` columns), ``curve``, ``drift``,
    ``hist``, ``removal`` (per pass, layer and head) and ``ppl`` (per pass)."""
    res = SinkStats(sink=sink, layers=layers).load_state(merged["stats"]).result()
    removal = pd.concat([SourceRemoval(m, sink=sink, layers=removal_layers).load_state(merged["removal"][m]).result()
                         for m in PASSES], ignore_index=True)
    heads = res["heads"]
    if len(removal):
        wide = removal.pivot_table(index=["layer", "head"], columns="mode",
                                   values=["output_norm", "log_output_norm", "cone", "cos_output_semantic",
                                           "removed_mass", "output_norm_sink_heavy", "cone_sink_heavy",
                                           "layer_output_norm"])
        wide.columns = [f"{v}_{PASS_SUFFIX[m]}" for v, m in wide.columns]
        heads = heads.merge(wide.reset_index(), on=["layer", "head"], how="left")
    n = int(merged["tokens"])
    ppl = {m: perplexity(merged["nll"][m], n) for m in PASSES}
    ppl_df = pd.DataFrame([{"pass": m, "nll": float(merged["nll"][m]), "tokens": n, "ppl": ppl[m],
                            "delta_ppl": ppl[m] - ppl["none"]} for m in PASSES])
    return {"heads": heads, "curve": res["curve"], "drift": res["drift"], "hist": res["hist"],
            "removal": removal, "ppl": ppl_df}


def _f(x) -> float | None:
    x = float(x)
    return None if not np.isfinite(x) else x


def summarize(heads: pd.DataFrame, hist: pd.DataFrame, ppl: pd.DataFrame, drift: pd.DataFrame | None = None) -> dict:
    """Per-model summary numbers (medians/means over heads; shares are over heads).

    Recomputable from an output directory: ``summarize(*(pd.read_parquet(out / f"{t}.parquet") for t
    in ("heads", "hist", "ppl", "drift")))``."""
    h = heads
    pp = ppl.set_index("pass")

    def pooled_median(q):
        lo, hi, bins = HISTOGRAMS[q]
        sub = hist[hist.quantity == q]
        width = (hi - lo) / bins
        counts = np.zeros(bins + 2)
        for blo, c in zip(sub.bin_lo, sub["count"]):
            k = 0 if not np.isfinite(blo) else int(round((blo - lo) / width)) + 1
            counts[min(k, bins + 1)] += c
        return histogram_quantile(counts, lo, hi, 0.5)

    base = h["output_norm_base"]
    out = {
        "heads": int(len(h)),
        "value_norm_ratio": _f(h["value_norm_ratio"].median()),
        "raw_value_norm_ratio": _f(h["raw_value_norm_ratio"].median()),
        "anti_aligned_share": _f(h["anti_aligned"].mean()),
        "cos_v0_m_median": _f(pooled_median("cos_v0_m")),
        "cos_v0_vj_median": _f(pooled_median("cos_v0_vj")),
        "cos_v0_vj_anti_aligned_share": _f((h["cos_v0_vj_median"] < 0).mean()),
        "interior_minimum_share": _f(h["rho_star_median_interior"].mean()),
        "rho_star_median": _f(pooled_median("rho_star")),
        "rho_star_interior_query_share": _f(np.average(h["rho_star_interior_share"].fillna(0), weights=h["queries"])
                                            if h["queries"].sum() else np.nan),
        "fit_convex_share": _f(h["fit_convex"].mean()),
        "fit_vertex_interior_share": _f(h["fit_vertex_interior"].mean()),
        "sink_rate_mean": _f(h["sink_rate"].mean()),
        "sink_contribution_mean": _f(h["sink_contribution"].mean()),
        "sink_negative_contribution_share": _f(h["sink_negative_share"].mean()),
        "decomposition": {
            part: {
                **{f"mean_{k}": _f(h[f"{part}_{k}"].mean()) for k in ("attention", "relative_norm", "cosine")},
                **{f"share_{k}": _f(h[f"{part}_share_{k}"].mean()) for k in ("attention", "relative_norm", "cosine")},
            }
            for part in ("sink", "tail")
        },
        "corr_sink_rate_entropy_mean": _f(h["corr_rho_entropy"].mean()),
        "cancel_median": _f(h["cancel"].median()),
        "norm_reduction_median": _f(h["norm_reduction"].median()),
        "ppl": _f(pp.loc["none", "ppl"]),
        "removal_delta_ppl": _f(pp.loc["sink", "delta_ppl"]),
        "control_delta_ppl": _f(pp.loc["control", "delta_ppl"]),
        "removal_output_norm_ratio": _f((h["output_norm_removed"] / base).median()),
        "control_output_norm_ratio": _f((h["output_norm_control"] / base).median()),
        "removal_output_norm_increase_share": _f((h["output_norm_removed"] > base).mean()),
        "cone_base": _f(h["cone_base"].mean()),
        "cone_removed": _f(h["cone_removed"].mean()),
        "cone_control": _f(h["cone_control"].mean()),
        "cone_sink_heavy_base": _f(h["cone_sink_heavy_base"].mean()),
        "cone_sink_heavy_removed": _f(h["cone_sink_heavy_removed"].mean()),
        "cone_sink_heavy_control": _f(h["cone_sink_heavy_control"].mean()),
        "removal_output_norm_ratio_sink_heavy": _f((h["output_norm_sink_heavy_removed"] / h["output_norm_sink_heavy_base"]).median()),
        "control_output_norm_ratio_sink_heavy": _f((h["output_norm_sink_heavy_control"] / h["output_norm_sink_heavy_base"]).median()),
        "cos_output_semantic_base": _f(h["cos_output_semantic_base"].mean()),
        "removed_mass_sink": _f(h["removed_mass_removed"].mean()),
        "removed_mass_control": _f(h["removed_mass_control"].mean()),
    }
    if drift is not None and len(drift):
        d = drift[drift.queries > 0]
        by = d.assign(w=d.sink_rate * d.queries).groupby("bin_lo")
        out["entropy_bins"] = [float(x) for x in sorted(d.bin_lo.unique())]
        out["sink_rate_by_entropy"] = [_f(x) for x in (by.w.sum() / by.queries.sum()).values]
        out["cancel_by_entropy_median"] = [_f(x) for x in d.groupby("bin_lo").cancel.median().values]
    return out


def experiment(handle: ModelHandleLike, run: RunLike, windows,
               settings: SinksSettings = SinksSettings()) -> ExperimentResult:
    """The sinks experiment over ``windows`` as one stage (``sinks``) of ``run`` (resumable, shareable
    among processes), with ``settings`` (:class:`~attngeom.sinks.settings.SinksSettings`). Returns an
    :class:`~attngeom.runs.contract.ExperimentResult`: the tables of :func:`results_from`, ``summary``
    (:func:`summarize`) and, when every record covers one window (``batch_size=1``),
    ``per_window["records"]``: the records of :func:`window_work` in window order, the additive sums
    a bootstrap over windows resamples."""
    sink, layers, removal_layers = settings.sink, settings.layers, settings.removal_layers
    batch_size = settings.batch_size
    from attngeom.runs.run import fingerprint, merge_sums
    from attngeom.streaming.passes import to_ids

    ids = [to_ids(handle, w) for w in windows]
    work = window_work(handle, ids, sink=sink, layers=layers, removal_layers=removal_layers, batch_size=batch_size)
    records = run.stage("sinks", len(ids), work, group=batch_size, desc="sinks", unit="window",
                        fingerprints=[fingerprint(w) for w in ids])
    merged = merge_sums(records.values())
    tables = results_from(merged, sink=sink, layers=layers, removal_layers=removal_layers)
    summary = summarize(tables["heads"], tables["hist"], tables["ppl"], tables["drift"])
    per_window = {}
    recs = window_records(records)
    if recs is not None:
        per_window["records"] = recs
    return ExperimentResult("sinks", tables=tables, summary=summary, per_window=per_window,
                            settings=settings.record())
