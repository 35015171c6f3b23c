"""Attention sinks (SPEC §4): the corpus reducer :class:`SinkStats` and its parts (value norms,
queries, semantic drift, the contribution's decomposition), with additive, mergeable state; the
quantities are those of :mod:`attngeom.sinks.geometry`."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from attngeom.metrics import formulas as metrics
from attngeom.capture.blocks import Block
from attngeom.sinks.geometry import (bin_sums, histogram_counts, histogram_quantile, log_share_sums, pair_factors,
                                     pearson, quadratic_fit, sink_terms, variance_shares)
from attngeom.streaming.reducers import InputBatch, Reducer, add_into

# Histogram ranges (lo, hi, bins) per distribution; 0 (and 1 for ρ*) are bin edges, so the sign of
# a median read from the histogram (and whether it is inside (0, 1)) is exact.
HISTOGRAMS = {
    "cos_v0_m": (-1.0, 1.0, 200),
    "cos_v0_vj": (-1.0, 1.0, 200),
    "rho_star": (-4.0, 5.0, 900),
}
SINK_RATE_BINS = 20
ENTROPY_BINS = 10


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
        add_into(self.acc.setdefault(layer, {}), key, x)

    def _binned(self, layer: int, name: str, bins: torch.Tensor, nb: int, w: torch.Tensor,
                values: dict[str, torch.Tensor]) -> None:
        """Per head, sums and counts of ``values`` over the queries in each of ``nb`` bins
        (``bins [B, H, Q]``), on the block's device (:func:`bin_sums`)."""
        keys, weights = [f"{name}_n"], [w]
        for k, x in values.items():
            ok = torch.isfinite(x) & (w > 0)
            xv = torch.where(ok, x, torch.zeros_like(w)) * w
            keys += [f"{name}_{k}_n", f"{name}_{k}_sum"]
            weights += [ok.double() * w, xv]
            if k == "output_norm":
                keys.append(f"{name}_{k}_sq")
                weights.append(xv * x.nan_to_num())
        for key, x in zip(keys, bin_sums(bins, nb, torch.stack([x.double() for x in weights]))):
            self._add(layer, key, x)

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
    if block.q_start + Q <= sink + 1:           # no query after the sink (decided without reading the block)
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

    def begin(self, batch: InputBatch) -> None:
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
            "value_norm_ratio": ratio_of_means(A["vj_norm_sum"][h], ns, A["v0_norm_sum"][h], nt),
            "raw_value_norm_ratio": ratio_of_means(A["vj_raw_norm_sum"][h], ns, A["v0_raw_norm_sum"][h], nt),
            "cos_v0_vj": A["cos_v0_vj_sum"][h] / ns if ns else np.nan,
        }
        row.update(_quantiles("cos_v0_vj", A["hist_cos_v0_vj"][h]))
        return row

    def head_tables(self, layer, A, h) -> dict[str, list[dict]]:
        return {"hist": _hist_rows(layer, h, "cos_v0_vj", A["hist_cos_v0_vj"][h])}


def ratio_of_means(num_sum, num_n, den_sum, den_n) -> float:
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
        return {"corr_rho_entropy": pearson(*A["corr_rho_entropy"][h])}

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

    def begin(self, batch: InputBatch) -> None:
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
            A = [{k: x.cpu().numpy() for k, x in p.acc.get(layer, {}).items()} for p in self.parts]
            if "n" not in A[1] or not A[1]["n"].any():      # no query after the sink in this layer
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
