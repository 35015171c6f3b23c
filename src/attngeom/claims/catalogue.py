"""The papers' claims (:data:`CLAIMS`: wording, measure, verdict rule), the verdict rules and the rows
that turn each analysis's resampled summary into verdicts.

The general rule: a claim **holds** when the whole 95 % interval of its measure lies on the claim's
side of the threshold, is **refuted** when the whole interval lies on the other side, and is
**inconclusive** otherwise. Claims of a range (``3–10×``, ``5.8–17.2 %``) hold when the interval lies
inside the range and are refuted when it lies entirely outside it. ``docs/claims.md``'s table of the
claims is checked against :data:`CLAIMS` (tests/unit/test_claims.py).

What belongs here: the catalogue, the rules and the formatting of rows. Not here: running the
experiments and resampling them (:mod:`attngeom.claims.experiment`), the statistics themselves
(each analysis's ``resampled(per_window, weights)``), the Markdown (:mod:`attngeom.reports.claims`).

A claim measured on fewer than :data:`attngeom.stats.resampling.MIN_UNITS` windows gets no interval
and the verdict **too few windows** (:func:`sized`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from attngeom.stats import resampling
from attngeom.metrics import registry
from attngeom.claims.settings import ClaimsSettings as Settings

HOLDS, REFUTED, INCONCLUSIVE = "holds", "refuted", "inconclusive"
TOO_FEW = resampling.TOO_FEW
MODERATE = (90.0, 75.0)
"""Retentions (percent of heads kept) that count as moderate removal."""

DEFAULTS = Settings()

CONTRIBUTION_PAPER = "Contribution Weights (Cunningham & Muca Cirone)"
SELECTION_PAPER = "Geometric Analysis of Token Selection (Mudarisov et al.)"

CLAIMS: tuple[dict, ...] = (
    {"id": "hierarchy_comprehensiveness", "paper": CONTRIBUTION_PAPER,
     "wording": "a clear faithfulness hierarchy: raw attention < value-weighted attention < value-weighted "
                "output-normalised attention < contribution weights (comprehensiveness: removing the tokens a "
                "more faithful metric ranks highest raises ΔPPL more)",
     "measure": "comprehensiveness AOC (mean ΔPPL over removal ratios) of each metric; the three adjacent "
                "differences of the hierarchy",
     "rule": "holds when each adjacent difference (more faithful − less faithful AOC) has its whole 95 % "
             "interval above 0; refuted when at least one has its whole interval below 0; else inconclusive"},
    {"id": "contribution_best_comprehensiveness", "paper": CONTRIBUTION_PAPER,
     "wording": "contribution weights consistently outperform attention-based metrics (comprehensiveness)",
     "measure": "comprehensiveness AOC of contribution minus that of each of the other three metrics",
     "rule": "holds when all three differences have their whole 95 % interval above 0; refuted when one is "
             "entirely below 0; else inconclusive"},
    {"id": "hierarchy_sufficiency", "paper": CONTRIBUTION_PAPER,
     "wording": "the same hierarchy on sufficiency: removing the tokens a more faithful metric ranks lowest "
                "keeps the model closer to its baseline (smaller ΔPPL)",
     "measure": "sufficiency AOC of each metric; the three adjacent differences (less faithful − more faithful)",
     "rule": "holds when each adjacent difference (less faithful − more faithful AOC) has its whole 95 % "
             "interval above 0; refuted when one is entirely below 0; else inconclusive"},
    {"id": "contribution_best_sufficiency", "paper": CONTRIBUTION_PAPER,
     "wording": "removing the tokens contribution weights rank least important keeps the model's accuracy, "
                "better than the attention-based metrics (sufficiency)",
     "measure": "sufficiency AOC of each other metric minus that of contribution",
     "rule": "holds when all three differences have their whole 95 % interval above 0; refuted when one is "
             "entirely below 0; else inconclusive"},
    {"id": "sink_value_small", "paper": SELECTION_PAPER,
     "wording": "the sink token's value norm is 3–10× smaller than that of the non-sink tokens",
     "measure": "median over heads of mean non-sink ‖v_j‖ / sink ‖v_0‖ (value states in head space)",
     "rule": "holds when the 95 % interval lies inside [3, 10]; refuted when it lies entirely outside "
             "[3, 10]; else inconclusive"},
    {"id": "sink_anti_aligned", "paper": CONTRIBUTION_PAPER,
     "wording": "the sink's value vector is systematically anti-aligned with the semantic tokens (negative "
                "cosine), causing destructive interference",
     "measure": "share of heads whose median cos(ṽ_0, m_i) over queries is negative (m_i: the non-sink "
                "part of the head output)",
     "rule": "holds when the 95 % interval lies above 50 % of heads; refuted when below 50 %; else inconclusive"},
    {"id": "convex_interior_minimum", "paper": CONTRIBUTION_PAPER,
     "wording": "the sink rate / output norm relation is convex, not monotone: the minimum output norm occurs "
                "at an intermediate sink rate (α < 1), not when the sink takes all the attention",
     "measure": "share of heads whose least-squares quadratic of ‖o_i^h‖ in the sink rate is convex with its "
                "vertex inside (0, 1)",
     "rule": "holds when the 95 % interval lies above 50 % of heads; refuted when below 50 %; else inconclusive"},
    {"id": "sink_removal_raises_norm", "paper": CONTRIBUTION_PAPER,
     "wording": "removing the sink's value vector (norm) raises the head output norms it was suppressing",
     "measure": "median over heads of mean ‖o^h‖ after / before sink removal",
     "rule": "holds when the 95 % interval lies above 1; refuted when below 1; else inconclusive"},
    {"id": "sink_removal_cone_collapse", "paper": CONTRIBUTION_PAPER,
     "wording": "sink removal collapses the low-norm head outputs into the semantic cone",
     "measure": "cone measure (attention-weighted mean cosine of o_i^h with the non-sink values) on sink-heavy "
                "queries (sink rate ≥ 0.5), mean over heads, after − before removal",
     "rule": "holds when the 95 % interval lies above 0; refuted when below 0; else inconclusive"},
    {"id": "sink_removal_ppl", "paper": CONTRIBUTION_PAPER,
     "wording": "sink removal increases noise and perplexity",
     "measure": "ΔPPL of removing the sink's value at every layer (control: the closest-mass non-sink source)",
     "rule": "holds when the 95 % interval lies above 0; refuted when below 0; else inconclusive"},
    {"id": "topn_more_separable", "paper": SELECTION_PAPER,
     "wording": "top-attention subsets are consistently more geometrically separable than random subsets of "
                "the same size",
     "measure": "mean F_N (Euclidean, last query, all layers and heads) of the top-N minus that of random "
                "N-subsets, at every N of the run; the value is the smallest difference over N",
     "rule": "holds when the difference's 95 % interval lies above 0 at every N; refuted when it lies below 0 "
             "at some N; else inconclusive"},
    {"id": "sink_lowers_f", "paper": SELECTION_PAPER,
     "wording": "including the sink in the top-N selection lowers the separation score F_N substantially, often "
                "by a factor of 2",
     "measure": "mean F_N of the top-N with the sink excluded from the candidates / with it, averaged over N",
     "rule": "holds when the 95 % interval lies above 1; refuted when below 1; else inconclusive (the factor "
             "of 2 is reported, not required)"},
    {"id": "retriever_share", "paper": SELECTION_PAPER,
     "wording": "Retriever heads are a consistent minority across models (5.8–17.2 %)",
     "measure": "share of heads whose most frequent source winner is the current token (all windows)",
     "rule": "holds when the 95 % interval lies inside [5.8 %, 17.2 %]; refuted when it lies entirely outside; "
             "else inconclusive"},
    {"id": "taxonomy_removal_calibrated", "paper": SELECTION_PAPER,
     "wording": "the taxonomy is a useful coarse signal for structured head removal, especially at moderate "
                "retention (beating single-metric baselines such as weight magnitude and entropy there)",
     "measure": "held-out log(PPL_baseline / PPL_taxonomy) at 90 % and 75 % retention, for the weight-magnitude "
                "and the attention-entropy orders; taxonomy order chosen on the calibration windows; the value "
                "is the smallest of the four",
     "rule": "holds when all four 95 % intervals lie above 0; refuted when one lies below 0; else inconclusive"},
    {"id": "taxonomy_removal_fixed", "paper": SELECTION_PAPER,
     "wording": "as above, with a fixed a-priori regime order (Mixer first, then Reset, Retriever last)",
     "measure": "as above with the fixed order",
     "rule": "as above"},
    {"id": "early_critical_head", "paper": SELECTION_PAPER,
     "wording": "a single head in an early layer (Gemma-7B layer 0, head 12) whose removal causes a clear "
                "failure: regime averages can hide individually critical heads",
     "measure": "largest z = (ΔPPL_h − mean) / std of the single-removal ΔPPL of the other heads of its regime "
                "(leave-one-out; the whole model when the regime has < 8 other heads), over heads in the "
                "first third of the layers (calibration windows)",
     "rule": "holds when the 95 % interval of that largest z lies above the critical threshold k (3); refuted "
             "when below k; else inconclusive"},
)

HEAD_TO_HEAD = "Head-to-head with published value-aware measures (SPEC §2.1)"
MODE_WORDS = {"comprehensiveness": ("comprehensiveness", "removing the tokens contribution ranks highest raises "
                                    "ΔPPL more than removing those {x} ranks highest"),
              "sufficiency": ("sufficiency", "removing the tokens contribution ranks lowest keeps ΔPPL smaller than "
                              "removing those {x} ranks lowest")}


def rival_claim_id(rival: str, mode: str) -> str:
    return f"contribution_beats_{rival}_{mode}"


def rival_claims() -> tuple[dict, ...]:
    """One claim per published measure of the head-to-head (:func:`attngeom.metrics.registry.rivals`)
    and faithfulness mode: contribution is more faithful than it, judged like claims 2 and 4."""
    out = []
    for x in registry.rivals():
        name = registry.label(x)
        for mode, (word, how) in MODE_WORDS.items():
            out.append({"id": rival_claim_id(x, mode), "paper": HEAD_TO_HEAD,
                        "wording": f"contribution is more faithful than {name} ({word}: {how.format(x=name)})",
                        "measure": f"{word} AOC of contribution minus that of {name} "
                                   f"({'larger' if mode == 'comprehensiveness' else 'smaller'} ΔPPL is better)",
                        "rule": "holds when the difference's whole 95 % interval is on contribution's side; refuted "
                                "when it is all on the other side; else inconclusive"})
    return tuple(out)


CLAIMS = CLAIMS + rival_claims()
CLAIM_BY_ID = {c["id"]: c for c in CLAIMS}
CLAIM_NUMBER = {c["id"]: k for k, c in enumerate(CLAIMS, 1)}

PAPER_ABBREVIATIONS = {CONTRIBUTION_PAPER: "CW", SELECTION_PAPER: "TS", HEAD_TO_HEAD: "H2H"}
"""How ``docs/claims.md`` names the two papers in its table."""


def catalogue_table() -> str:
    """The Markdown table of :data:`CLAIMS` that ``docs/claims.md`` shows (one row per claim: number,
    id, paper, claim, what is measured, verdict rule); tests/unit/test_claims.py checks the page
    holds exactly this table."""
    lines = ["| # | id | paper | claim | measured | verdict rule |", "|--:|---|---|---|---|---|"]
    lines += [f"| {k} | `{c['id']}` | {PAPER_ABBREVIATIONS[c['paper']]} | {c['wording']} | {c['measure']} | {c['rule']} |"
              for k, c in enumerate(CLAIMS, 1)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------


def verdict_side(low, high, threshold: float = 0.0, claim_above: bool = True) -> str:
    """The general rule: the whole interval on the claim's side of ``threshold`` -> holds, on the
    other side -> refuted, else inconclusive."""
    s = resampling.side_of(low, high, threshold)
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


DECIDING_NOTE = "the margin the verdict rests on (of those that must all lie above 0, the one whose interval lies lowest)"
"""How a row of several margins judged together (:func:`verdict_all`) says which one it shows (:func:`deciding`)."""
ALL_MARGINS = ("contribution_best_comprehensiveness", "contribution_best_sufficiency", "taxonomy_removal_calibrated",
               "taxonomy_removal_fixed")
"""The claims whose row shows one of several margins judged together (:func:`verdict_all`)."""


def deciding(numbers: dict) -> dict:
    """Of several margins judged together by :func:`verdict_all` (each a dict with ``value``, ``low``,
    ``high``), the one the verdict comes from, so that the row shows it: one wholly below 0 (refuted;
    the lowest), else the one whose interval reaches lowest (its lower end above 0 means every one is:
    holds; at or below 0, inconclusive); without intervals, the smallest value."""
    ds = [d for d in numbers.values() if isinstance(d, dict) and d.get("value") is not None]
    below = [d for d in ds if d.get("high") is not None and d["high"] < 0]
    if below:
        return min(below, key=lambda d: d["high"])
    bounded = [d for d in ds if d.get("low") is not None]
    if bounded:
        return min(bounded, key=lambda d: d["low"])
    return min(ds, key=lambda d: d["value"])


def claim_number(claim_id: str) -> int:
    """A claim's number: its place in :data:`CLAIMS` from 1, the same in every run (``--skip`` leaves
    gaps, it does not renumber)."""
    return CLAIM_NUMBER[claim_id]


def row_windows(row: dict, windows: dict) -> int | None:
    """The windows a row's interval rests on: its own record, else (runs written before rows recorded
    it) from the run's ``windows`` record: the calibration windows for the early critical head, the
    held-out windows for the taxonomy removal, the corpus windows otherwise."""
    if row.get("windows") is not None:
        return int(row["windows"])
    key = {"early_critical_head": "calibration_windows", "taxonomy_removal_calibrated": "heldout_windows",
           "taxonomy_removal_fixed": "heldout_windows"}.get(row["id"], "windows")
    n = windows.get(key, windows.get("windows"))
    return None if n is None else int(n)


def under_current_rules(stored: dict) -> dict:
    """A run's stored ``claims.json`` content judged by the current rules, nothing recomputed: each row
    records the windows it rests on (:func:`row_windows`); a row on fewer than
    :data:`~attngeom.stats.resampling.MIN_UNITS` gets no interval and the verdict **too few windows**
    (:func:`sized`; the early critical head says what would give it one, :func:`calibration_evidence`);
    a row of several margins judged together shows the one its verdict comes from (:func:`deciding`)."""
    import copy

    out = copy.deepcopy(stored)
    info = out.get("windows") or {}
    rows = []
    for r in out["rows"]:
        n = row_windows(r, info)
        if r["id"] in ALL_MARGINS and r.get("numbers"):
            d = deciding(r["numbers"])
            signed = r["id"].startswith("taxonomy")
            r.update(value=fmt_num(d["value"], signed=signed), low=d["low"], high=d["high"],
                     interval="—" if d["low"] is None or d["high"] is None else f"[{fmt_num(d['low'])}, {fmt_num(d['high'])}]")
            if r.get("note"):
                r["note"] = (r["note"].replace("value: the smallest AOC", f"value: {DECIDING_NOTE}, an AOC")
                             .replace("value: the smallest log", f"value: {DECIDING_NOTE}, a log"))
        if n is not None and not resampling.enough_units(n) and r["verdict"] != TOO_FEW:
            r = sized([r], {}, n)[0]
            if r["id"] == "early_critical_head":
                r = calibration_evidence([r], n)[0]
        elif n is not None:
            r["windows"] = n
        rows.append(r)
    out["rows"] = rows
    return out


def verdict_all(intervals: Sequence[tuple], threshold: float = 0.0) -> str:
    """Several differences that must all be above ``threshold``: all intervals above -> holds, any
    entirely below -> refuted, else inconclusive."""
    sides = [resampling.side_of(lo, hi, threshold) for lo, hi in intervals]
    if sides and all(s > 0 for s in sides):
        return HOLDS
    if any(s < 0 for s in sides):
        return REFUTED
    return INCONCLUSIVE


# --------------------------------------------------------------------------------------------
# Rows: each analysis's resampled summary -> verdicts
# --------------------------------------------------------------------------------------------


def faithfulness_rows(point: dict, samples: dict, metrics: Sequence[str], rivals: Sequence[str] = ()
                      ) -> tuple[list[dict], dict]:
    """The faithfulness claims (1-4, when the hierarchy's metrics are all present) and the head-to-head
    rows of ``rivals`` (contribution against each), from the resampled summary."""
    rows, detail = [], {"aoc": {}, "log_aoc": {}, "delta_ppl": {}, "beats": {}, "clean_ppl": None}
    detail["clean_ppl"] = resampling.interval_dict(point["clean"][0], samples["clean"])
    for (m, mode), s in samples["aoc"].items():
        detail["aoc"].setdefault(mode, {})[m] = resampling.interval_dict(point["aoc"][(m, mode)][0], s)
        detail["log_aoc"].setdefault(mode, {})[m] = resampling.interval_dict(point["log_aoc"][(m, mode)][0],
                                                                     samples["log_aoc"][(m, mode)])
    for (m, mode, r), s in samples["delta"].items():
        detail["delta_ppl"].setdefault(mode, {}).setdefault(m, {})[f"{r:g}"] = resampling.interval_dict(
            point["delta"][(m, mode, r)][0], s)
    present = [m for m in metrics if (m, "comprehensiveness") in samples["aoc"]]
    for mode in ("comprehensiveness", "sufficiency"):
        larger = mode == "comprehensiveness"
        mat = np.stack([samples["aoc"][(m, mode)] for m in present], 1)
        share = resampling.beats_share(mat, larger_is_better=larger)
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
            if rivals:
                rows += rival_rows(mode, rivals, present, diff, point, samples)
            continue
        adj = [(hierarchy[k + 1], hierarchy[k]) for k in range(len(hierarchy) - 1)]
        diffs = {f"{b} vs {w}": diff(b, w) for b, w in adj}
        verdict = verdict_all([(d["low"], d["high"]) for d in diffs.values()])
        order = detail["order"][mode]
        ratios = sorted({r for (m, md, r) in samples["delta"] if md == mode and m in hierarchy})
        per_ratio = per_ratio_verdicts(point, samples, mode, adj, ratios)
        rows.append(claim_row(f"hierarchy_{mode}", value=" > ".join(m for m in order if m in hierarchy),
                         interval="; ".join(f"{k.replace(' vs ', ' beats ')} in {fmt_pct(d['beats_share'])}" for k, d in diffs.items()),
                         verdict=verdict, numbers=diffs, per_ratio=per_ratio))
        pairs = [(hierarchy[-1], w) for w in hierarchy[:-1]]
        best = {f"{b} vs {w}": diff(b, w) for b, w in pairs}
        low = deciding(best)
        rows.append(claim_row(f"contribution_best_{mode}", value=fmt_num(low["value"]), low=low["low"], high=low["high"],
                         verdict=verdict_all([(d["low"], d["high"]) for d in best.values()]), numbers=best,
                         per_ratio=per_ratio_verdicts(point, samples, mode, pairs, ratios),
                         note=f"value: {DECIDING_NOTE}, an AOC margin of contribution over another metric "
                              "(ΔPPL units; positive = contribution better)"))
        if rivals:
            rows += rival_rows(mode, rivals, present, diff, point, samples)
    return rows, detail


def rival_rows(mode: str, rivals: Sequence[str], present: Sequence[str], diff, point: dict, samples: dict) -> list[dict]:
    """The head-to-head rows of ``mode``: contribution against each measure of ``rivals`` present
    (``diff(better, worse)``: the AOC margin with its interval), with the verdict at every ratio."""
    rows = []
    ratios = sorted({r for (m, md, r) in samples["delta"] if md == mode and m == "contribution"})
    for x in rivals:
        if x not in present or "contribution" not in present:
            continue
        d = diff("contribution", x)
        rows.append(claim_row(rival_claim_id(x, mode), value=fmt_num(d["value"]), low=d["low"], high=d["high"],
                              verdict=verdict_all([(d["low"], d["high"])]), numbers={f"contribution vs {x}": d},
                              per_ratio=per_ratio_verdicts(point, samples, mode, [("contribution", x)], ratios),
                              note=f"value: the AOC margin of contribution over {registry.label(x)} (ΔPPL units; "
                                   f"positive = contribution better); beats in {fmt_pct(d['beats_share'])} of resamples"))
    return rows


def margin(mode: str, point_better: np.ndarray, point_worse: np.ndarray, samples_better: np.ndarray,
           samples_worse: np.ndarray) -> dict:
    """How far ``better`` beats ``worse`` on a faithfulness curve (comprehensiveness: larger ΔPPL is
    better; sufficiency: smaller), point value (``[0]`` of the point arrays) and 95 % interval."""
    sign = 1.0 if mode == "comprehensiveness" else -1.0
    return resampling.interval_dict(sign * (point_better[0] - point_worse[0]), sign * (samples_better - samples_worse))


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


def sink_rows(point: dict, samples: dict) -> tuple[list[dict], dict]:
    d = {k: resampling.interval_dict(point[k][0], samples[k]) for k in samples}
    rows = []
    r = d["value_norm_ratio_raw"]
    rows.append(claim_row("sink_value_small", value=fmt_num(r["value"], "×"), low=r["low"], high=r["high"],
                     verdict=verdict_range(r["low"], r["high"], 3.0, 10.0), unit="×",
                     numbers={"raw": r, "projected (ṽ = v W_O)": d["value_norm_ratio_projected"]}))
    r = d["anti_aligned_share"]
    rows.append(claim_row("sink_anti_aligned", value=fmt_pct(r["value"]), low=r["low"], high=r["high"], unit="%",
                     verdict=verdict_side(r["low"], r["high"], 0.5),
                     numbers={"share": r, "pooled median cos(ṽ_0, m_i)": d["cos_v0_m_pooled_median"]}))
    r = d["fit_vertex_interior_share"]
    rows.append(claim_row("convex_interior_minimum", value=fmt_pct(r["value"]), low=r["low"], high=r["high"], unit="%",
                     verdict=verdict_side(r["low"], r["high"], 0.5),
                     numbers={"convex with interior vertex": r, "convex": d["fit_convex_share"],
                              "median per-query ρ* inside (0, 1)": d["rho_star_median_interior_share"]}))
    r = d["removal_output_norm_ratio"]
    rows.append(claim_row("sink_removal_raises_norm", value=fmt_num(r["value"], "×"), low=r["low"], high=r["high"],
                     unit="×", verdict=verdict_side(r["low"], r["high"], 1.0),
                     numbers={"sink removal": r, "control removal": d["control_output_norm_ratio"]}))
    r = d["cone_sink_heavy_change"]
    rows.append(claim_row("sink_removal_cone_collapse", value=fmt_num(r["value"], signed=True), low=r["low"],
                     high=r["high"], verdict=verdict_side(r["low"], r["high"], 0.0),
                     numbers={"sink-heavy: before": d["cone_sink_heavy_base"], "sink-heavy: after": d["cone_sink_heavy_removed"],
                              "sink-heavy: control": d["cone_sink_heavy_control"], "all queries: change": d["cone_change"],
                              "all queries: before": d["cone_base"], "all queries: after": d["cone_removed"]}))
    r = d["removal_delta_ppl"]
    rows.append(claim_row("sink_removal_ppl", value=fmt_num(r["value"], signed=True), low=r["low"], high=r["high"],
                     verdict=verdict_side(r["low"], r["high"], 0.0),
                     numbers={"ppl": d["ppl"], "sink removal ΔPPL": r, "control ΔPPL": d["control_delta_ppl"]}))
    return rows, d


def selection_rows(point: dict, samples: dict, ns: Sequence[int]) -> tuple[list[dict], dict]:
    detail = {"f_n": {kind: {str(n): resampling.interval_dict(point[kind][0, i], samples[kind][:, i]) for i, n in enumerate(ns)}
                      for kind in samples}}
    rows = []
    if "topn" in samples and "random" in samples:
        diff_s = samples["topn"] - samples["random"]
        diff_p = point["topn"] - point["random"]
        per = {str(n): resampling.interval_dict(diff_p[0, i], diff_s[:, i]) for i, n in enumerate(ns)}
        detail["topn_minus_random"] = per
        k = int(np.nanargmin(diff_p[0]))
        m = per[str(ns[k])]
        rows.append(claim_row("topn_more_separable", value=f"{fmt_num(m['value'], signed=True)} (N = {ns[k]})",
                         low=m["low"], high=m["high"], verdict=verdict_all([(x["low"], x["high"]) for x in per.values()]),
                         numbers=per, note="value: the smallest top-N − random difference of mean F_N over N"))
    if "topn" in samples and "topn_nosink" in samples:
        ratio_s = np.nanmean(samples["topn_nosink"], 1) / np.nanmean(samples["topn"], 1)
        ratio_p = np.nanmean(point["topn_nosink"], 1) / np.nanmean(point["topn"], 1)
        r = resampling.interval_dict(ratio_p[0], ratio_s)
        detail["nosink_over_with_sink"] = r
        per = {str(n): resampling.interval_dict(point["topn_nosink"][0, i] / point["topn"][0, i],
                                        samples["topn_nosink"][:, i] / samples["topn"][:, i]) for i, n in enumerate(ns)}
        rows.append(claim_row("sink_lowers_f", value=fmt_num(r["value"], "×"), low=r["low"], high=r["high"], unit="×",
                         verdict=verdict_side(r["low"], r["high"], 1.0), numbers={"mean over N": r, **{f"N = {k}": v for k, v in per.items()}}))
    return rows, detail


def regime_rows(point: np.ndarray, samples: np.ndarray) -> tuple[list[dict], dict]:
    from attngeom.heads.taxonomy import REGIMES

    d = {r: resampling.interval_dict(point[0, k], samples[:, k]) for k, r in enumerate(REGIMES)}
    r = d["Retriever"]
    return [claim_row("retriever_share", value=fmt_pct(r["value"]), low=r["low"], high=r["high"], unit="%",
                 verdict=verdict_range(r["low"], r["high"], 0.058, 0.172),
                 numbers={f"{k} share": v for k, v in d.items()})], d


def removal_row(claim_id: str, regime_order: Sequence[str], ppl_point: dict, ppl_samples: dict,
                   retentions: Sequence[float]) -> dict:
    """``ppl_*[(order, retention)]``: held-out PPL, point ``float`` and resampled ``[R]``."""
    numbers = {}
    for base in ("weight", "entropy"):
        for r in retentions:
            if r not in MODERATE:
                continue
            p = math.log(ppl_point[(base, r)] / ppl_point[("taxonomy", r)])
            s = np.log(ppl_samples[(base, r)] / ppl_samples[("taxonomy", r)])
            numbers[f"vs {base} at {r:g} %"] = resampling.interval_dict(p, s)
    if not numbers:
        return claim_row(claim_id, value="n/a", verdict=INCONCLUSIVE, note="no moderate retention (90 % or 75 %) in the run")
    low = deciding(numbers)
    return claim_row(claim_id, value=fmt_num(low["value"], signed=True), low=low["low"], high=low["high"],
                verdict=verdict_all([(d["low"], d["high"]) for d in numbers.values()]), numbers=numbers,
                note=f"regime order {' > '.join(regime_order)} (first removed first); value: {DECIDING_NOTE}, "
                     "a log PPL ratio baseline / taxonomy (positive = taxonomy better)")


def early_critical_row(z: dict, head: dict, same: float, num_layers: int, base_ppl: float, critical_k: float) -> dict:
    """The early-critical-head claim: ``z`` the interval of the largest early leave-one-out z, ``head``
    the top early head (with its ΔPPL and interval), ``same`` the share of resamples where it stays
    the top early head, ``base_ppl`` the calibration split's unedited perplexity."""
    return claim_row("early_critical_head", value=f"z = {fmt_num(z['value'])} (layer {head['layer']}, head {head['head']}, "
                     f"ΔPPL {fmt_num(head['delta_ppl'], signed=True)})", low=z["low"], high=z["high"],
                     verdict=verdict_side(z["low"], z["high"], critical_k),
                     numbers={"largest early z": z, "its ΔPPL": head["delta_ppl_interval"]},
                     note=f"early = layers 0–{math.ceil(num_layers / 3) - 1}; the same head is the top early head in "
                          f"{fmt_pct(same)} of resamples; calibration base PPL {fmt_num(base_ppl)}")


# --------------------------------------------------------------------------------------------
# Rows and formatting
# --------------------------------------------------------------------------------------------


def claim_row(claim_id: str, *, value, verdict: str, low=None, high=None, interval: str | None = None, unit: str = "",
         numbers: dict | None = None, note: str | None = None, per_ratio: dict | None = None) -> dict:
    c = CLAIM_BY_ID[claim_id]
    if interval is None:
        if low is None or high is None:
            interval = "—"
        elif unit == "%":
            interval = f"[{fmt_pct(low)}, {fmt_pct(high)}]"
        else:
            interval = f"[{fmt_num(low)}, {fmt_num(high)}]"
    return {"id": claim_id, "paper": c["paper"], "claim": c["wording"], "measure": c["measure"], "rule": c["rule"],
            "value": value, "low": low, "high": high, "interval": interval, "verdict": verdict,
            "numbers": numbers or {}, "note": note, **({"per_ratio": per_ratio} if per_ratio else {})}


def fmt_num(x, suffix: str = "", signed: bool = False) -> str:
    s = resampling.format_number(x, signed)
    return s if s == "—" else s + suffix


def fmt_pct(x) -> str:
    return "—" if x is None or not np.isfinite(x) else f"{100 * x:.1f} %"


def sized(rows: list[dict], detail: dict, windows: int) -> list[dict]:
    """Record on each row the number of windows its interval rests on; below
    :data:`~attngeom.stats.resampling.MIN_UNITS` every interval of the rows and of ``detail`` is
    withheld (``low``/``high`` None) and the verdict is :data:`TOO_FEW`."""
    for r in rows:
        r["windows"] = windows
    if resampling.enough_units(windows):
        return rows
    _withhold(detail)
    for r in rows:
        _withhold(r)
        r.pop("per_ratio", None)
        r.update(verdict=TOO_FEW, interval="—",
                 note=f"{windows} window(s); intervals need at least {resampling.MIN_UNITS}" + (f"; {r['note']}" if r["note"] else ""))
    return rows


def calibration_evidence(rows: list[dict], windows: int) -> list[dict]:
    """Say on the calibration-window claim's rows what their evidence is: the single-head removal on
    the ``windows`` calibration windows alone; and, when that is below
    :data:`~attngeom.stats.resampling.MIN_UNITS` (the default: 2, since the single-head removal is
    most of a run's cost), what gives it a verdict."""
    need = resampling.MIN_UNITS
    for r in rows:
        what = f"evidence: single-head removal on the {windows} calibration window(s) only"
        if not resampling.enough_units(windows):
            what += (f"; a verdict needs --calib-windows {need} (and --max-windows {2 * need} to keep "
                     f"{need} held-out windows for claims 14–15), about {need / windows:g}× the single-head "
                     "removal's cost")
        r["note"] = what + (f"; {r['note']}" if r["note"] else "")
    return rows


def _withhold(obj) -> None:
    """Set ``low``/``high`` to None in every interval (a dict with ``value``, ``low`` and ``high``) in ``obj``."""
    if isinstance(obj, dict):
        if {"value", "low", "high"} <= obj.keys():
            obj["low"] = obj["high"] = None
        for v in obj.values():
            _withhold(v)
    elif isinstance(obj, list):
        for v in obj:
            _withhold(v)
