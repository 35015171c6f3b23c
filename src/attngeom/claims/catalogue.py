"""Every claim of the two papers, measured on one model with bootstrap intervals and a verdict.

The claims experiment runs reduced versions of the four corpus experiments in ONE
:class:`~attngeom.runs.run.Run`, every record per window (batch size 1), and reads each through its
public result (:class:`~attngeom.runs.contract.ExperimentResult`: tables, summary and the per-window
sums in ``per_window``), so that a bootstrap over windows can resample them
(:mod:`attngeom.stats.resampling`): for ``n_resamples`` resamples (default 1000, seeded) the per-window
sums are re-added with the resample's counts and every statistic below is recomputed, giving a
95 % percentile interval. The one stage of its own is the held-out removal in the fixed regime
order (:func:`attngeom.heads.removal.removal_nll`, stage ``removal_fixed``) when that order differs from
the calibrated one.

Windows: faithfulness, sinks and selection use all windows; head removal uses the first
``calib_windows`` as the calibration split (taxonomy regimes, single-head sensitivity, the chosen
regime order) and the rest as the held-out split (removal curves). Taxonomy regime shares use all
windows. Each statistic is resampled over the windows it was measured on.

The claims, their wording, what is measured and the verdict rule are listed in :data:`CLAIMS`
(and in ``docs/claims.md``). The general rule: a claim **holds** when the whole 95 % interval of its
measure lies on the claim's side of the threshold, is **refuted** when the whole interval lies on
the other side, and is **inconclusive** otherwise. Claims of a range (``3–10×``, ``5.8–17.2 %``)
hold when the interval lies inside the range and are refuted when it lies entirely outside it.

No CLI imports here; :mod:`attngeom.commands.claims` is the command, :mod:`attngeom.reports.claims`
the Markdown.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


from attngeom.model.arguments import takes_handle
from attngeom.stats import resampling as bs
from attngeom.metrics import registry
from attngeom.runs.contract import ExperimentResult, ModelHandleLike, RunLike, perplexity
from attngeom.claims.settings import ClaimsSettings as Settings
from attngeom.faithfulness.settings import FaithfulnessSettings
from attngeom.heads.settings import HeadsSettings
from attngeom.selection.settings import SelectionSettings
from attngeom.sinks.settings import SinksSettings

HOLDS, REFUTED, INCONCLUSIVE = "holds", "refuted", "inconclusive"
MODERATE = (90.0, 75.0)
"""Retentions (percent of heads kept) that count as moderate removal."""

DEFAULTS = Settings()

P1 = "Contribution Weights (Cunningham & Muca Cirone)"
P2 = "Geometric Analysis of Token Selection (Mudarisov et al.)"

CLAIMS: tuple[dict, ...] = (
    {"id": "hierarchy_comprehensiveness", "paper": P1,
     "wording": "a clear faithfulness hierarchy: raw attention < value-weighted attention < value-weighted "
                "output-normalised attention < contribution weights (comprehensiveness: removing the tokens a "
                "more faithful metric ranks highest raises ΔPPL more)",
     "measure": "comprehensiveness AOC (mean ΔPPL over removal ratios) of each metric; the three adjacent "
                "differences of the hierarchy",
     "rule": "holds when each adjacent difference (more faithful − less faithful AOC) has its whole 95 % "
             "interval above 0; refuted when at least one has its whole interval below 0; else inconclusive"},
    {"id": "contribution_best_comprehensiveness", "paper": P1,
     "wording": "contribution weights consistently outperform attention-based metrics (comprehensiveness)",
     "measure": "comprehensiveness AOC of contribution minus that of each of the other three metrics",
     "rule": "holds when all three differences have their whole 95 % interval above 0; refuted when one is "
             "entirely below 0; else inconclusive"},
    {"id": "hierarchy_sufficiency", "paper": P1,
     "wording": "the same hierarchy on sufficiency: removing the tokens a more faithful metric ranks lowest "
                "keeps the model closer to its baseline (smaller ΔPPL)",
     "measure": "sufficiency AOC of each metric; the three adjacent differences (less faithful − more faithful)",
     "rule": "holds when each adjacent difference (less faithful − more faithful AOC) has its whole 95 % "
             "interval above 0; refuted when one is entirely below 0; else inconclusive"},
    {"id": "contribution_best_sufficiency", "paper": P1,
     "wording": "removing the tokens contribution weights rank least important keeps the model's accuracy, "
                "better than the attention-based metrics (sufficiency)",
     "measure": "sufficiency AOC of each other metric minus that of contribution",
     "rule": "holds when all three differences have their whole 95 % interval above 0; refuted when one is "
             "entirely below 0; else inconclusive"},
    {"id": "sink_value_small", "paper": P2,
     "wording": "the sink token's value norm is 3–10× smaller than that of the non-sink tokens",
     "measure": "median over heads of mean non-sink ‖v_j‖ / sink ‖v_0‖ (value states in head space)",
     "rule": "holds when the 95 % interval lies inside [3, 10]; refuted when it lies entirely outside "
             "[3, 10]; else inconclusive"},
    {"id": "sink_anti_aligned", "paper": P1,
     "wording": "the sink's value vector is systematically anti-aligned with the semantic tokens (negative "
                "cosine), causing destructive interference",
     "measure": "share of heads whose median cos(ṽ_0, m_i) over queries is negative (m_i: the non-sink "
                "part of the head output)",
     "rule": "holds when the 95 % interval lies above 50 % of heads; refuted when below 50 %; else inconclusive"},
    {"id": "convex_interior_minimum", "paper": P1,
     "wording": "the sink rate / output norm relation is convex, not monotone: the minimum output norm occurs "
                "at an intermediate sink rate (α < 1), not when the sink takes all the attention",
     "measure": "share of heads whose least-squares quadratic of ‖o_i^h‖ in the sink rate is convex with its "
                "vertex inside (0, 1)",
     "rule": "holds when the 95 % interval lies above 50 % of heads; refuted when below 50 %; else inconclusive"},
    {"id": "sink_removal_raises_norm", "paper": P1,
     "wording": "removing the sink's value vector (norm) raises the head output norms it was suppressing",
     "measure": "median over heads of mean ‖o^h‖ after / before sink removal",
     "rule": "holds when the 95 % interval lies above 1; refuted when below 1; else inconclusive"},
    {"id": "sink_removal_cone_collapse", "paper": P1,
     "wording": "sink removal collapses the low-norm head outputs into the semantic cone",
     "measure": "cone measure (attention-weighted mean cosine of o_i^h with the non-sink values) on sink-heavy "
                "queries (sink rate ≥ 0.5), mean over heads, after − before removal",
     "rule": "holds when the 95 % interval lies above 0; refuted when below 0; else inconclusive"},
    {"id": "sink_removal_ppl", "paper": P1,
     "wording": "sink removal increases noise and perplexity",
     "measure": "ΔPPL of removing the sink's value at every layer (control: the closest-mass non-sink source)",
     "rule": "holds when the 95 % interval lies above 0; refuted when below 0; else inconclusive"},
    {"id": "topn_more_separable", "paper": P2,
     "wording": "top-attention subsets are consistently more geometrically separable than random subsets of "
                "the same size",
     "measure": "mean F_N (Euclidean, last query, all layers and heads) of the top-N minus that of random "
                "N-subsets, at every N of the run; the value is the smallest difference over N",
     "rule": "holds when the difference's 95 % interval lies above 0 at every N; refuted when it lies below 0 "
             "at some N; else inconclusive"},
    {"id": "sink_lowers_f", "paper": P2,
     "wording": "including the sink in the top-N selection lowers the separation score F_N substantially, often "
                "by a factor of 2",
     "measure": "mean F_N of the top-N with the sink excluded from the candidates / with it, averaged over N",
     "rule": "holds when the 95 % interval lies above 1; refuted when below 1; else inconclusive (the factor "
             "of 2 is reported, not required)"},
    {"id": "retriever_share", "paper": P2,
     "wording": "Retriever heads are a consistent minority across models (5.8–17.2 %)",
     "measure": "share of heads whose most frequent source winner is the current token (all windows)",
     "rule": "holds when the 95 % interval lies inside [5.8 %, 17.2 %]; refuted when it lies entirely outside; "
             "else inconclusive"},
    {"id": "taxonomy_removal_calibrated", "paper": P2,
     "wording": "the taxonomy is a useful coarse signal for structured head removal, especially at moderate "
                "retention (beating single-metric baselines such as weight magnitude and entropy there)",
     "measure": "held-out log(PPL_baseline / PPL_taxonomy) at 90 % and 75 % retention, for the weight-magnitude "
                "and the attention-entropy orders; taxonomy order chosen on the calibration windows; the value "
                "is the smallest of the four",
     "rule": "holds when all four 95 % intervals lie above 0; refuted when one lies below 0; else inconclusive"},
    {"id": "taxonomy_removal_fixed", "paper": P2,
     "wording": "as above, with a fixed a-priori regime order (Mixer first, then Reset, Retriever last)",
     "measure": "as above with the fixed order",
     "rule": "as above"},
    {"id": "early_critical_head", "paper": P2,
     "wording": "a single head in an early layer (Gemma-7B layer 0, head 12) whose removal causes a clear "
                "failure: regime averages can hide individually critical heads",
     "measure": "largest z = (ΔPPL_h − mean) / std of the single-removal ΔPPL of the other heads of its regime "
                "(leave-one-out; the whole model when the regime has < 8 other heads), over heads in the "
                "first third of the layers (calibration windows)",
     "rule": "holds when the 95 % interval of that largest z lies above the critical threshold k (3); refuted "
             "when below k; else inconclusive"},
)
CLAIM_BY_ID = {c["id"]: c for c in CLAIMS}


# --------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------


def verdict_side(low, high, threshold: float = 0.0, claim_above: bool = True) -> str:
    """The general rule: the whole interval on the claim's side of ``threshold`` -> holds, on the
    other side -> refuted, else inconclusive."""
    s = bs.side_of(low, high, threshold)
    if s == 0:
        return INCONCLUSIVE
    return HOLDS if (s > 0) == claim_above else REFUTED


def verdict_range(low, high, lo: float, hi: float) -> str:
    """A range claim: interval inside ``[lo, hi]`` -> holds; entirely outside -> refuted."""
    if low is None or high is None:
        return INCONCLUSIVE
    if lo <= low and high <= hi:
        return HOLDS
    if high < lo or low > hi:
        return REFUTED
    return INCONCLUSIVE


def verdict_all(intervals: Sequence[tuple], threshold: float = 0.0) -> str:
    """Several differences that must all be above ``threshold``: all intervals above -> holds, any
    entirely below -> refuted, else inconclusive."""
    sides = [bs.side_of(lo, hi, threshold) for lo, hi in intervals]
    if sides and all(s > 0 for s in sides):
        return HOLDS
    if any(s < 0 for s in sides):
        return REFUTED
    return INCONCLUSIVE


# --------------------------------------------------------------------------------------------
# Vectorised pieces (tested against the experiments' own code)
# --------------------------------------------------------------------------------------------


def hist_quantile(counts: np.ndarray, lo: float, hi: float, q: float) -> np.ndarray:
    """:func:`attngeom.sinks.suppression.histogram_quantile` over the last axis: ``counts [..., bins + 2]`` ->
    ``[...]`` (NaN where empty)."""
    c = np.asarray(counts, dtype=np.float64)
    bins = c.shape[-1] - 2
    width = (hi - lo) / bins
    total = c.sum(-1)
    cum = np.cumsum(c, -1)
    target = q * total
    k = np.minimum((cum < target[..., None]).sum(-1), bins + 1)
    below = np.take_along_axis(cum, np.maximum(k - 1, 0)[..., None], -1)[..., 0]
    ck = np.take_along_axis(c, k[..., None], -1)[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(ck > 0, (target - below) / np.where(ck > 0, ck, 1.0), 0.5)
    out = lo + (k - 1 + frac) * width
    out = np.where(k == 0, lo, np.where(k == bins + 1, hi, out))
    return np.where(total > 0, out, np.nan)


def quadratic_vertex_interior(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`attngeom.sinks.suppression.quadratic_fit` over the last axis: ``sums [..., 9]`` -> ``(convex,
    vertex_interior)`` boolean ``[...]``."""
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


def _layers(d: dict) -> list:
    """Keys of a per-layer dict in layer order (keys are ints or their strings)."""
    return sorted(d, key=lambda k: int(k))


def _stack(records: Sequence[dict], get) -> np.ndarray:
    return np.stack([np.asarray(get(r), dtype=np.float64) for r in records])


# --------------------------------------------------------------------------------------------
# Faithfulness
# --------------------------------------------------------------------------------------------


def faithfulness_stats(nll: np.ndarray, tokens: np.ndarray, variants: Sequence, counts: np.ndarray) -> dict:
    """Resampled faithfulness numbers. ``nll [W, V]`` summed NLL per window and variant (column 0
    the clean forward), ``tokens [W]``, ``counts [R, W]``. Returns arrays ``[R]``: ``clean``,
    ``aoc[(metric, mode)]``, ``log_aoc[(metric, mode)]`` and ``delta[(metric, mode, ratio)]``
    (random: mean over seeds)."""
    ppl = bs.perplexity(counts, nll, tokens)                      # [R, V]
    clean = ppl[:, 0]
    groups: dict = {}
    for k, v in enumerate(variants):
        if v.metric is None:
            continue
        groups.setdefault((v.metric, v.mode), []).append(k)
    out = {"clean": clean, "aoc": {}, "log_aoc": {}, "delta": {}}
    for key, cols in groups.items():
        out["aoc"][key] = (ppl[:, cols] - clean[:, None]).mean(1)
        out["log_aoc"][key] = np.log(ppl[:, cols] / clean[:, None]).mean(1)
        by_ratio: dict = {}
        for c in cols:
            by_ratio.setdefault(variants[c].ratio, []).append(c)
        for r, cs in by_ratio.items():
            out["delta"][key + (r,)] = (ppl[:, cs] - clean[:, None]).mean(1)
    return out


def _faith_claims(point: dict, samples: dict, metrics: Sequence[str]) -> tuple[list[dict], dict]:
    rows, detail = [], {"aoc": {}, "log_aoc": {}, "delta_ppl": {}, "beats": {}, "clean_ppl": None}
    detail["clean_ppl"] = bs.interval_dict(point["clean"][0], samples["clean"])
    for (m, mode), s in samples["aoc"].items():
        detail["aoc"].setdefault(mode, {})[m] = bs.interval_dict(point["aoc"][(m, mode)][0], s)
        detail["log_aoc"].setdefault(mode, {})[m] = bs.interval_dict(point["log_aoc"][(m, mode)][0],
                                                                     samples["log_aoc"][(m, mode)])
    for (m, mode, r), s in samples["delta"].items():
        detail["delta_ppl"].setdefault(mode, {}).setdefault(m, {})[f"{r:g}"] = bs.interval_dict(
            point["delta"][(m, mode, r)][0], s)
    present = [m for m in metrics if (m, "comprehensiveness") in samples["aoc"]]
    for mode in ("comprehensiveness", "sufficiency"):
        larger = mode == "comprehensiveness"
        mat = np.stack([samples["aoc"][(m, mode)] for m in present], 1)
        share = bs.beats_share(mat, larger_is_better=larger)
        detail["beats"][mode] = {a: {b: float(share[i, j]) for j, b in enumerate(present) if b != a}
                                 for i, a in enumerate(present)}
        pts = {m: point["aoc"][(m, mode)][0] for m in present}
        detail.setdefault("order", {})[mode] = sorted(present, key=lambda m: -pts[m] if larger else pts[m])

        def diff(better: str, worse: str) -> dict:
            d = margin(mode, point["aoc"][(better, mode)], point["aoc"][(worse, mode)],
                       samples["aoc"][(better, mode)], samples["aoc"][(worse, mode)])
            d["beats_share"] = float(share[present.index(better), present.index(worse)])
            return d

        hierarchy = registry.hierarchy()                                  # least faithful first
        if not all(m in present for m in hierarchy):
            continue
        adj = [(hierarchy[k + 1], hierarchy[k]) for k in range(len(hierarchy) - 1)]
        diffs = {f"{b} vs {w}": diff(b, w) for b, w in adj}
        verdict = verdict_all([(d["low"], d["high"]) for d in diffs.values()])
        order = detail["order"][mode]
        ratios = sorted({r for (m, md, r) in samples["delta"] if md == mode and m in hierarchy})
        per_ratio = per_ratio_verdicts(point, samples, mode, adj, ratios)
        rows.append(_row(f"hierarchy_{mode}", value=" > ".join(m for m in order if m in hierarchy),
                         interval="; ".join(f"{k.replace(' vs ', ' beats ')} in {d['beats_share']:.0%}" for k, d in diffs.items()),
                         verdict=verdict, numbers=diffs, per_ratio=per_ratio))
        pairs = [(hierarchy[-1], w) for w in hierarchy[:-1]]
        best = {f"{b} vs {w}": diff(b, w) for b, w in pairs}
        low = min(best.values(), key=lambda d: d["value"] if d["value"] is not None else np.inf)
        rows.append(_row(f"contribution_best_{mode}", value=_fmt_num(low["value"]), low=low["low"], high=low["high"],
                         verdict=verdict_all([(d["low"], d["high"]) for d in best.values()]), numbers=best,
                         per_ratio=per_ratio_verdicts(point, samples, mode, pairs, ratios),
                         note="value: the smallest AOC margin of contribution over another metric "
                              "(ΔPPL units; positive = contribution better)"))
    return rows, detail


def margin(mode: str, point_better: np.ndarray, point_worse: np.ndarray, samples_better: np.ndarray,
           samples_worse: np.ndarray) -> dict:
    """How far ``better`` beats ``worse`` on a faithfulness curve (comprehensiveness: larger ΔPPL is
    better; sufficiency: smaller), point value (``[0]`` of the point arrays) and 95 % interval."""
    sign = 1.0 if mode == "comprehensiveness" else -1.0
    return bs.interval_dict(sign * (point_better[0] - point_worse[0]), sign * (samples_better - samples_worse))


def per_ratio_verdicts(point: dict, samples: dict, mode: str, pairs: Sequence[tuple[str, str]],
                       ratios: Sequence[float]) -> dict:
    """A faithfulness claim judged at each removal ratio alone, by the rule it has over the AOC: for
    each ratio, ``(better, worse)`` pairs compared by ΔPPL at that ratio (comprehensiveness: larger is
    better; sufficiency: smaller), every difference with its 95 % interval, and the verdict of all
    pairs. ``crossover``: the ratios between which the verdict changes (an AOC verdict that holds at
    some ratios and not at others is carried by those ratios, and the report says so)."""
    out: dict = {"ratios": {}}
    for r in ratios:
        numbers = {}
        for b, w in pairs:
            numbers[f"{b} vs {w}"] = margin(mode, point["delta"][(b, mode, r)], point["delta"][(w, mode, r)],
                                            samples["delta"][(b, mode, r)], samples["delta"][(w, mode, r)])
        out["ratios"][f"{r:g}"] = {"verdict": verdict_all([(d["low"], d["high"]) for d in numbers.values()]),
                                   "numbers": numbers}
    keys = list(out["ratios"])
    out["crossover"] = [f"{a}–{b}: {out['ratios'][a]['verdict']} → {out['ratios'][b]['verdict']}"
                        for a, b in zip(keys, keys[1:]) if out["ratios"][a]["verdict"] != out["ratios"][b]["verdict"]]
    out["summary"] = " · ".join(f"r={k}: {v['verdict']}" for k, v in out["ratios"].items())
    return out


# --------------------------------------------------------------------------------------------
# Sinks
# --------------------------------------------------------------------------------------------


def _sink_acc(stats: dict) -> dict:
    """The per-layer sums of a :class:`~attngeom.sinks.suppression.SinkStats` state: ``{layer: {key: array}}``
    (a state of one ``acc``, or of several parts each with its own ``acc``: merged, the first part
    holding a key wins)."""
    if "acc" in stats:
        return stats["acc"]
    out: dict = {}
    for part in stats.values():
        for layer, d in (part.get("acc") or {}).items():
            mine = out.setdefault(layer, {})
            for k, x in d.items():
                mine.setdefault(k, x)
    return out


def sink_arrays(records: Sequence[dict]) -> dict[str, np.ndarray]:
    """Per-window arrays from the sinks stage's records (one window each): ``[W, L, H, ...]``."""
    keys = ("n_texts", "n_sources", "v0_norm_sum", "vj_norm_sum", "v0_raw_norm_sum", "vj_raw_norm_sum",
            "hist_cos_v0_m", "hist_rho_star", "fit", "n")
    out = {}
    accs = [_sink_acc(r["stats"]) for r in records]
    for k in keys:
        out[k] = _stack(accs, lambda a: [a[l][k] for l in _layers(a)])
    for mode in ("none", "sink", "control"):
        for k in ("n", "output_norm", "cone", "heavy_n", "heavy_output_norm", "heavy_cone"):
            out[f"{mode}_{k}"] = _stack(records, lambda r: [r["removal"][mode]["acc"][l][k]
                                                            for l in _layers(r["removal"][mode]["acc"])])
        out[f"nll_{mode}"] = _stack(records, lambda r: r["nll"][mode])
    out["tokens"] = _stack(records, lambda r: r["tokens"])
    return out


def sink_stats(X: dict[str, np.ndarray], counts: np.ndarray) -> dict[str, np.ndarray]:
    """Resampled sink numbers ``[R]`` from :func:`sink_arrays` (the definitions of
    :func:`attngeom.sinks.suppression.summarize`)."""
    from attngeom.sinks.suppression import HISTOGRAMS

    S = lambda k: bs.resample_sums(counts, X[k])                    # noqa: E731
    n_resamples = counts.shape[0]

    def flat(x):
        return x.reshape(n_resamples, -1)

    with np.errstate(invalid="ignore", divide="ignore"):
        ns, nt = S("n_sources"), S("n_texts")
        ok = (ns > 0) & (nt > 0)
        raw = np.where(ok, (S("vj_raw_norm_sum") / ns) / (S("v0_raw_norm_sum") / nt), np.nan)
        proj = np.where(ok, (S("vj_norm_sum") / ns) / (S("v0_norm_sum") / nt), np.nan)
        hc = S("hist_cos_v0_m")
        lo, hi, _ = HISTOGRAMS["cos_v0_m"]
        med_cos = hist_quantile(hc, lo, hi, 0.5)                        # [R, L, H]
        pooled_cos = hist_quantile(flat(hc).reshape(n_resamples, -1, hc.shape[-1]).sum(1), lo, hi, 0.5)
        lo_r, hi_r, _ = HISTOGRAMS["rho_star"]
        med_rho = hist_quantile(S("hist_rho_star"), lo_r, hi_r, 0.5)
        convex, interior = quadratic_vertex_interior(S("fit"))
        mean = {}
        for mode in ("none", "sink", "control"):
            n = S(f"{mode}_n")
            hn = S(f"{mode}_heavy_n")
            mean[mode] = {
                "output_norm": np.where(n > 0, S(f"{mode}_output_norm") / n, np.nan),
                "cone": np.where(n > 0, S(f"{mode}_cone") / n, np.nan),
                "heavy_cone": np.where(hn > 0, S(f"{mode}_heavy_cone") / hn, np.nan),
            }
        tok = S("tokens")
        ppl = {m: perplexity(S(f"nll_{m}"), tok) for m in ("none", "sink", "control")}
    return {
        "value_norm_ratio_raw": bs.nanmedian_rows(flat(raw)),
        "value_norm_ratio_projected": bs.nanmedian_rows(flat(proj)),
        "anti_aligned_share": (flat(med_cos) < 0).mean(1),
        "cos_v0_m_pooled_median": pooled_cos,
        "fit_convex_share": flat(convex).mean(1),
        "fit_vertex_interior_share": flat(interior).mean(1),
        "rho_star_median_interior_share": flat((med_rho > 0) & (med_rho < 1)).mean(1),
        "removal_output_norm_ratio": bs.nanmedian_rows(flat(mean["sink"]["output_norm"] / mean["none"]["output_norm"])),
        "control_output_norm_ratio": bs.nanmedian_rows(flat(mean["control"]["output_norm"] / mean["none"]["output_norm"])),
        "cone_base": bs.nanmean_rows(flat(mean["none"]["cone"])),
        "cone_removed": bs.nanmean_rows(flat(mean["sink"]["cone"])),
        "cone_control": bs.nanmean_rows(flat(mean["control"]["cone"])),
        "cone_sink_heavy_base": bs.nanmean_rows(flat(mean["none"]["heavy_cone"])),
        "cone_sink_heavy_removed": bs.nanmean_rows(flat(mean["sink"]["heavy_cone"])),
        "cone_sink_heavy_control": bs.nanmean_rows(flat(mean["control"]["heavy_cone"])),
        "cone_sink_heavy_change": bs.nanmean_rows(flat(mean["sink"]["heavy_cone"])) - bs.nanmean_rows(flat(mean["none"]["heavy_cone"])),
        "cone_change": bs.nanmean_rows(flat(mean["sink"]["cone"])) - bs.nanmean_rows(flat(mean["none"]["cone"])),
        "ppl": ppl["none"],
        "removal_delta_ppl": ppl["sink"] - ppl["none"],
        "control_delta_ppl": ppl["control"] - ppl["none"],
    }


def _sink_claims(point: dict, samples: dict) -> tuple[list[dict], dict]:
    d = {k: bs.interval_dict(point[k][0], samples[k]) for k in samples}
    rows = []
    r = d["value_norm_ratio_raw"]
    rows.append(_row("sink_value_small", value=_fmt_num(r["value"], "×"), low=r["low"], high=r["high"],
                     verdict=verdict_range(r["low"], r["high"], 3.0, 10.0), unit="×",
                     numbers={"raw": r, "projected (ṽ = v W_O)": d["value_norm_ratio_projected"]}))
    r = d["anti_aligned_share"]
    rows.append(_row("sink_anti_aligned", value=_fmt_pct(r["value"]), low=r["low"], high=r["high"], unit="%",
                     verdict=verdict_side(r["low"], r["high"], 0.5),
                     numbers={"share": r, "pooled median cos(ṽ_0, m_i)": d["cos_v0_m_pooled_median"]}))
    r = d["fit_vertex_interior_share"]
    rows.append(_row("convex_interior_minimum", value=_fmt_pct(r["value"]), low=r["low"], high=r["high"], unit="%",
                     verdict=verdict_side(r["low"], r["high"], 0.5),
                     numbers={"convex with interior vertex": r, "convex": d["fit_convex_share"],
                              "median per-query ρ* inside (0, 1)": d["rho_star_median_interior_share"]}))
    r = d["removal_output_norm_ratio"]
    rows.append(_row("sink_removal_raises_norm", value=_fmt_num(r["value"], "×"), low=r["low"], high=r["high"],
                     unit="×", verdict=verdict_side(r["low"], r["high"], 1.0),
                     numbers={"sink removal": r, "control removal": d["control_output_norm_ratio"]}))
    r = d["cone_sink_heavy_change"]
    rows.append(_row("sink_removal_cone_collapse", value=_fmt_num(r["value"], signed=True), low=r["low"],
                     high=r["high"], verdict=verdict_side(r["low"], r["high"], 0.0),
                     numbers={"sink-heavy: before": d["cone_sink_heavy_base"], "sink-heavy: after": d["cone_sink_heavy_removed"],
                              "sink-heavy: control": d["cone_sink_heavy_control"], "all queries: change": d["cone_change"],
                              "all queries: before": d["cone_base"], "all queries: after": d["cone_removed"]}))
    r = d["removal_delta_ppl"]
    rows.append(_row("sink_removal_ppl", value=_fmt_num(r["value"], signed=True), low=r["low"], high=r["high"],
                     verdict=verdict_side(r["low"], r["high"], 0.0),
                     numbers={"ppl": d["ppl"], "sink removal ΔPPL": r, "control ΔPPL": d["control_delta_ppl"]}))
    return rows, d


# --------------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------------


def selection_arrays(sel: "pandas.DataFrame", n_windows: int, ns: Sequence[int], distance: str = "euclidean") -> dict:
    """Per-window sums of F and row counts: ``{kind: (sum [W, N], count [W, N])}`` for the kinds of
    :data:`attngeom.selection.topn.KINDS`."""
    d = sel[sel["distance"] == distance]
    out = {}
    ns = list(ns)
    for kind, g in d.groupby("kind"):
        s = np.zeros((n_windows, len(ns)))
        c = np.zeros((n_windows, len(ns)))
        agg = g.groupby(["window", "N"])["F"].agg(["sum", "count"]).reset_index()
        for w, n, x, k in zip(agg["window"], agg["N"], agg["sum"], agg["count"]):
            if int(n) in ns and 0 <= int(w) < n_windows:
                s[int(w), ns.index(int(n))] += x
                c[int(w), ns.index(int(n))] += k
        out[str(kind)] = (s, c)
    return out


def selection_stats(X: dict, counts: np.ndarray) -> dict[str, np.ndarray]:
    """Mean F per N ``[R, N]`` per kind, from :func:`selection_arrays`."""
    return {kind: bs.ratio_of_sums(counts, s, c) for kind, (s, c) in X.items()}


def _selection_claims(point: dict, samples: dict, ns: Sequence[int]) -> tuple[list[dict], dict]:
    detail = {"f_n": {kind: {str(n): bs.interval_dict(point[kind][0, i], samples[kind][:, i]) for i, n in enumerate(ns)}
                      for kind in samples}}
    rows = []
    if "topn" in samples and "random" in samples:
        diff_s = samples["topn"] - samples["random"]
        diff_p = point["topn"] - point["random"]
        per = {str(n): bs.interval_dict(diff_p[0, i], diff_s[:, i]) for i, n in enumerate(ns)}
        detail["topn_minus_random"] = per
        k = int(np.nanargmin(diff_p[0]))
        m = per[str(ns[k])]
        rows.append(_row("topn_more_separable", value=f"{_fmt_num(m['value'], signed=True)} (N = {ns[k]})",
                         low=m["low"], high=m["high"], verdict=verdict_all([(x["low"], x["high"]) for x in per.values()]),
                         numbers=per, note="value: the smallest top-N − random difference of mean F_N over N"))
    if "topn" in samples and "topn_nosink" in samples:
        ratio_s = np.nanmean(samples["topn_nosink"], 1) / np.nanmean(samples["topn"], 1)
        ratio_p = np.nanmean(point["topn_nosink"], 1) / np.nanmean(point["topn"], 1)
        r = bs.interval_dict(ratio_p[0], ratio_s)
        detail["nosink_over_with_sink"] = r
        per = {str(n): bs.interval_dict(point["topn_nosink"][0, i] / point["topn"][0, i],
                                        samples["topn_nosink"][:, i] / samples["topn"][:, i]) for i, n in enumerate(ns)}
        rows.append(_row("sink_lowers_f", value=_fmt_num(r["value"], "×"), low=r["low"], high=r["high"], unit="×",
                         verdict=verdict_side(r["low"], r["high"], 1.0), numbers={"mean over N": r, **{f"N = {k}": v for k, v in per.items()}}))
    return rows, detail


# --------------------------------------------------------------------------------------------
# Taxonomy and head removal
# --------------------------------------------------------------------------------------------


def winner_arrays(tax_records: Sequence[dict]) -> np.ndarray:
    """Per-window source-winner sums ``[W, L, H, 3]`` (self, sink, other) from taxonomy records."""
    def get(r):
        sums = r["tax"]["sums"]
        return [np.stack([sums[l]["winner_self"], sums[l]["winner_sink"], sums[l]["winner_other"]], -1)
                for l in _layers(sums)]
    return _stack(tax_records, get)


def regime_share_stats(X: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Regime shares ``[R, 3]`` (Retriever, Mixer, Reset) of resampled winner sums ``[W, L, H, 3]``;
    plurality with ties to the first (as :func:`attngeom.heads.taxonomy.regimes_of`)."""
    s = bs.resample_sums(counts, X)                                  # [R, L, H, 3]
    reg = s.argmax(-1).reshape(counts.shape[0], -1)                  # [R, L*H]
    return np.stack([(reg == k).mean(1) for k in range(3)], 1)


def critical_z(delta: np.ndarray, regimes: np.ndarray, min_group: int = 8) -> np.ndarray:
    """Leave-one-out z of every head's single-removal ΔPPL within its regime (the whole model when
    the regime has fewer than ``min_group`` other heads), as :func:`attngeom.heads.removal.critical_heads`:
    ``delta [R, K]``, ``regimes [K]`` -> ``[R, K]`` (NaN where the others have no spread)."""
    delta = np.asarray(delta, dtype=np.float64)
    K = delta.shape[1]
    z = np.full(delta.shape, np.nan)
    groups = {}
    for r in np.unique(regimes):
        idx = np.nonzero(regimes == r)[0]
        groups[r] = idx if len(idx) - 1 >= min_group else np.arange(K)
    for k in range(K):
        idx = groups[regimes[k]]
        if len(idx) < 2:
            continue
        g = delta[:, idx]
        n = len(idx) - 1
        s = g.sum(1) - delta[:, k]
        q = (g * g).sum(1) - delta[:, k] ** 2
        mu = s / n
        sd = np.sqrt(np.maximum(q / n - mu * mu, 0))
        with np.errstate(invalid="ignore", divide="ignore"):
            z[:, k] = np.where(sd > 0, (delta[:, k] - mu) / np.where(sd > 0, sd, 1), np.nan)
    return z


def _regime_claims(point: np.ndarray, samples: np.ndarray) -> tuple[list[dict], dict]:
    from attngeom.heads.taxonomy import REGIMES

    d = {r: bs.interval_dict(point[0, k], samples[:, k]) for k, r in enumerate(REGIMES)}
    r = d["Retriever"]
    return [_row("retriever_share", value=_fmt_pct(r["value"]), low=r["low"], high=r["high"], unit="%",
                 verdict=verdict_range(r["low"], r["high"], 0.058, 0.172),
                 numbers={f"{k} share": v for k, v in d.items()})], d


def _removal_claim(claim_id: str, regime_order: Sequence[str], ppl_point: dict, ppl_samples: dict,
                   retentions: Sequence[float]) -> dict:
    """``ppl_*[(order, retention)]``: held-out PPL, point ``float`` and resampled ``[R]``."""
    numbers = {}
    for base in ("weight", "entropy"):
        for r in retentions:
            if r not in MODERATE:
                continue
            p = math.log(ppl_point[(base, r)] / ppl_point[("taxonomy", r)])
            s = np.log(ppl_samples[(base, r)] / ppl_samples[("taxonomy", r)])
            numbers[f"vs {base} at {r:g} %"] = bs.interval_dict(p, s)
    if not numbers:
        return _row(claim_id, value="n/a", verdict=INCONCLUSIVE, note="no moderate retention (90 % or 75 %) in the run")
    low = min(numbers.values(), key=lambda d: d["value"])
    return _row(claim_id, value=_fmt_num(low["value"], signed=True), low=low["low"], high=low["high"],
                verdict=verdict_all([(d["low"], d["high"]) for d in numbers.values()]), numbers=numbers,
                note=f"regime order {' > '.join(regime_order)} (first removed first); value: the smallest "
                     "log PPL ratio baseline / taxonomy (positive = taxonomy better)")


# --------------------------------------------------------------------------------------------
# Rows and formatting
# --------------------------------------------------------------------------------------------


def _row(claim_id: str, *, value, verdict: str, low=None, high=None, interval: str | None = None, unit: str = "",
         numbers: dict | None = None, note: str | None = None, per_ratio: dict | None = None) -> dict:
    c = CLAIM_BY_ID[claim_id]
    if interval is None:
        if low is None or high is None:
            interval = "n/a"
        elif unit == "%":
            interval = f"[{_fmt_pct(low)}, {_fmt_pct(high)}]"
        else:
            interval = f"[{_fmt_num(low)}, {_fmt_num(high)}]"
    return {"id": claim_id, "paper": c["paper"], "claim": c["wording"], "measure": c["measure"], "rule": c["rule"],
            "value": value, "low": low, "high": high, "interval": interval, "verdict": verdict,
            "numbers": numbers or {}, "note": note, **({"per_ratio": per_ratio} if per_ratio else {})}


def _fmt_num(x, suffix: str = "", signed: bool = False) -> str:
    if x is None or not np.isfinite(x):
        return "n/a"
    a = abs(x)
    f = ".4g" if a < 1e5 else ",.0f"
    s = format(x, ("+" if signed else "") + f)
    return s + suffix


def _fmt_pct(x) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{100 * x:.1f} %"


# --------------------------------------------------------------------------------------------
# The experiment
# --------------------------------------------------------------------------------------------


@takes_handle
def experiment(handle: ModelHandleLike, run: RunLike, windows: Sequence, settings: Settings = DEFAULTS, *,
               analyses: Sequence[str] = ("faithfulness", "sinks", "selection", "heads")) -> ExperimentResult:
    """Run (or resume) the reduced experiments on ``windows`` in ``run`` (a
    :class:`~attngeom.runs.run.Run` or :class:`~attngeom.runs.run.Memory`), one window per record, and
    score every claim from their :class:`~attngeom.runs.contract.ExperimentResult` s.

    Returns an :class:`~attngeom.runs.contract.ExperimentResult` whose ``summary`` is ``{"rows": [one
    dict per claim, in the order of CLAIMS], "detail": {...}, "windows": {...}, "settings":
    {...}}`` and whose ``tables["claims"]`` holds the rows' id, verdict, value and interval; each row
    has ``value``, ``low``, ``high`` (95 % percentile bootstrap interval, ``settings.n_resamples``
    resamples of the windows, seeded by ``settings.seed``), ``interval`` (text), ``verdict`` and
    ``numbers`` (the intervals behind the verdict)."""
    import pandas as pd

    from attngeom.streaming.passes import to_ids

    ids = [to_ids(handle, w) for w in windows]
    W = len(ids)
    rows: list[dict] = []
    detail: dict = {}
    info = {"windows": W, "tokens_scored": int(sum(max(0, len(x) - 1) for x in ids))}

    st = settings

    def counts_for(n: int, salt: int) -> np.ndarray:
        return bs.resample_counts(n, st.n_resamples, st.seed * 1000 + salt)

    if "faithfulness" in analyses:
        r, detail["faithfulness"] = _faithfulness_part(handle, run, ids, st.ratios, st.seeds, counts_for)
        rows += r
    if "sinks" in analyses:
        r, detail["sinks"] = _sinks_part(handle, run, ids, counts_for)
        rows += r
    if "selection" in analyses:
        r, detail["selection"] = _selection_part(handle, run, ids, st.ns, st.repeats, st.seed, counts_for)
        rows += r
    if "heads" in analyses:
        r, detail["regimes"], detail["heads"] = _heads_part(handle, run, ids, st.calib_windows, st.retentions,
                                                            st.fixed_order, st.seed, st.critical_k, counts_for)
        rows += r
        info.update({"calibration_windows": st.calib_windows, "heldout_windows": W - st.calib_windows})

    order = {c["id"]: i for i, c in enumerate(CLAIMS)}
    rows.sort(key=lambda r: order[r["id"]])
    recorded = st.record(bs.DEFAULT_LEVEL)
    table = pd.DataFrame([{k: r[k] for k in ("id", "verdict", "value", "low", "high", "interval")} for r in rows],
                         columns=["id", "verdict", "value", "low", "high", "interval"])
    return ExperimentResult("claims", tables={"claims": table},
                            summary={"rows": rows, "detail": detail, "windows": info, "settings": recorded},
                            settings=recorded)


def _one_per_window(result: ExperimentResult, key: str) -> list:
    """``result.per_window[key]``: the records of one window each the bootstrap resamples."""
    recs = result.per_window.get(key)
    if recs is None:
        raise ValueError(f"the claims experiment needs one window per record of the {result.name} experiment "
                         "(batch size 1)")
    return recs


def _faithfulness_part(handle: ModelHandleLike, run: RunLike, ids, ratios, seeds, counts_for) -> tuple[list[dict], dict]:
    from attngeom.faithfulness import curves as faithfulness

    settings = FaithfulnessSettings(ratios=tuple(ratios), seeds=tuple(seeds))
    res = faithfulness.experiment(handle, run, units=faithfulness.window_units(ids), settings=settings)
    nll, tok, variants = res.per_window["nll"], res.per_window["tokens"], res.per_window["variants"]
    W = len(tok)
    point = faithfulness_stats(nll, tok, variants, np.ones((1, W)))
    samples = faithfulness_stats(nll, tok, variants, counts_for(W, 1))
    return _faith_claims(point, samples, settings.metrics)


def _sinks_part(handle: ModelHandleLike, run: RunLike, ids, counts_for) -> tuple[list[dict], dict]:
    from attngeom.sinks import suppression as sinks

    X = sink_arrays(_one_per_window(sinks.experiment(handle, run, ids, SinksSettings(batch_size=1)), "records"))
    W = len(ids)
    return _sink_claims(sink_stats(X, np.ones((1, W))), sink_stats(X, counts_for(W, 2)))


def _selection_part(handle: ModelHandleLike, run: RunLike, ids, ns, repeats, seed, counts_for) -> tuple[list[dict], dict]:
    from attngeom.selection import topn as selection

    res = selection.experiment(handle, run, ids, SelectionSettings(ns=tuple(ns), distances=("euclidean",), repeats=repeats,
                                                                   seed=seed, predict=False, batch_size=1))
    sel = res.tables["selection"]
    ns_used = sorted(int(n) for n in sel["N"].unique())
    W = len(ids)
    X = selection_arrays(sel, W, ns_used)
    return _selection_claims(selection_stats(X, np.ones((1, W))), selection_stats(X, counts_for(W, 3)), ns_used)


def _heads_part(handle: ModelHandleLike, run: RunLike, ids, calib_windows, retentions, fixed_order, seed, critical_k,
                counts_for) -> tuple[list[dict], dict, dict]:
    """Regime shares, removal (calibrated and fixed regime order) and the early critical head, from
    the heads experiment's result (and one more removal stage for the fixed order when it differs
    from the calibrated one)."""
    from attngeom.heads import removal as heads
    from attngeom.heads.taxonomy import REGIMES

    res = heads.experiment(handle, run, [ids], HeadsSettings(calib_windows=calib_windows, retentions=tuple(retentions),
                                                             seed=seed, critical_k=critical_k, batch_size=1))
    W = len(ids)
    tax = _one_per_window(res, "taxonomy")
    Xw = winner_arrays(tax)
    rows, regimes_detail = _regime_claims(regime_share_stats(Xw, np.ones((1, W))),
                                          regime_share_stats(Xw, counts_for(W, 4)))

    held = ids[calib_windows:]
    Wh, Wc = len(held), calib_windows
    chosen = list(res.summary["taxonomy_regime_order"])
    fixed = [str(x) for x in fixed_order]
    levels = [x for x in retentions if x < 100]
    removal = res.per_window["removal"]
    keys = list(removal["keys"])
    nll_r = removal["nll"]                                                            # [K, Wh]
    tok_h = np.asarray(removal["tokens"], dtype=np.float64)                          # [Wh]
    cal_df = res.tables["taxonomy_calibration"]
    if fixed == chosen:
        nll_f = nll_r[[keys.index(("taxonomy", x)) for x in levels]]
    else:
        removals = [heads.removed_at(heads.taxonomy_order(cal_df, fixed), x) for x in levels]
        nll_f, _ = heads.removal_nll(handle, run, "removal_fixed", held, removals, 1, "removal: fixed regime order")
    cnt_h = counts_for(Wh, 5)
    all_nll = np.concatenate([nll_r, nll_f], 0).T                                     # [Wh, K+F]
    ppl_pt = bs.perplexity(np.ones((1, Wh)), all_nll, tok_h)[0]
    ppl_s = bs.perplexity(cnt_h, all_nll, tok_h)
    keys = keys + [("fixed", x) for x in levels]
    P = {k: ppl_pt[i] for i, k in enumerate(keys)}
    S = {k: ppl_s[:, i] for i, k in enumerate(keys)}
    names = list(heads.ORDERS) + ["fixed"]
    for x in retentions:
        if x >= 100:
            for name in names:
                P[(name, x)], S[(name, x)] = P[("", 100.0)], S[("", 100.0)]
    curves = {}
    for name in names:
        label = {"taxonomy": f"taxonomy, chosen on calibration ({' > '.join(chosen)})",
                 "fixed": f"taxonomy, fixed ({' > '.join(fixed)})"}.get(name, name)
        curves[label] = {f"{x:g}": bs.interval_dict(P[(name, x)], S[(name, x)]) for x in retentions}
    rows.append(_removal_claim("taxonomy_removal_calibrated", chosen, P, S, retentions))
    Pf = {**P, **{("taxonomy", x): P[("fixed", x)] for x in retentions}}
    Sf = {**S, **{("taxonomy", x): S[("fixed", x)] for x in retentions}}
    rows.append(_removal_claim("taxonomy_removal_fixed", fixed, Pf, Sf, retentions))

    row, head = _early_critical_claim(handle, res, tax[:Wc], cal_df, critical_k, counts_for)
    rows.append(row)
    detail = {
        "regime_order_chosen": chosen, "regime_order_fixed": fixed,
        "order_search": res.tables["order_search"].to_dict(orient="records"),
        "removal_curves": curves, "critical_heads": res.summary["critical_heads"],
        "early_critical_head": head, "calibration_windows": Wc, "heldout_windows": Wh,
        "regimes": [str(x) for x in REGIMES],
    }
    return rows, regimes_detail, detail


def _early_critical_claim(handle: ModelHandleLike, res: ExperimentResult, calib_tax: Sequence[dict], cal_df,
                          critical_k: float, counts_for) -> tuple[dict, dict]:
    """The largest leave-one-out z of an early head's single-removal ΔPPL (calibration windows)."""
    L, H = handle.num_layers, handle.num_heads
    Wc = len(calib_tax)
    nll_s = np.asarray(res.per_window["sensitivity"], dtype=np.float64)              # [L*H, Wc]
    base_c = np.array([t["nll"] for t in calib_tax], dtype=np.float64)
    tok_c = np.array([t["tokens"] for t in calib_tax], dtype=np.float64)
    mat = np.concatenate([base_c[None], nll_s], 0).T                                # [Wc, 1+L*H]
    regimes = cal_df.sort_values(["layer", "head"])["regime"].to_numpy()

    def early_z(cnt):
        ppl = bs.perplexity(cnt, mat, tok_c)
        delta = ppl[:, 1:] - ppl[:, :1]
        z = critical_z(delta, regimes)
        early = np.array([(k // H) * 3 < L for k in range(L * H)])
        ze = np.where(early[None] & np.isfinite(z), z, -np.inf)
        return ze.max(1), ze.argmax(1), delta

    zp, kp, dp = early_z(np.ones((1, Wc)))
    zs, ks, ds = early_z(counts_for(Wc, 6))
    zs = np.where(np.isfinite(zs), zs, np.nan)
    zi = bs.interval_dict(zp[0] if np.isfinite(zp[0]) else np.nan, zs)
    k0 = int(kp[0])
    same = float(np.mean(ks == k0))
    head = {"layer": k0 // H, "head": k0 % H, "regime": str(regimes[k0]), "delta_ppl": float(dp[0, k0]),
            "delta_ppl_interval": bs.interval_dict(dp[0, k0], ds[:, k0]), "top_in_resamples": same}
    row = _row("early_critical_head", value=f"z = {_fmt_num(zi['value'])} (layer {head['layer']}, head {head['head']}, "
               f"ΔPPL {_fmt_num(head['delta_ppl'], signed=True)})", low=zi["low"], high=zi["high"],
               verdict=verdict_side(zi["low"], zi["high"], critical_k),
               numbers={"largest early z": zi, "its ΔPPL": head["delta_ppl_interval"]},
               note=f"early = layers 0–{math.ceil(L / 3) - 1}; the same head is the top early head in "
                    f"{same:.0%} of resamples; calibration base PPL "
                    f"{perplexity(base_c.sum(), tok_c.sum()):.4g}")
    return row, head
