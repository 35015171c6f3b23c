"""Every claim of the two papers, measured on one model with bootstrap intervals and a verdict.

The claims experiment runs reduced versions of the four corpus experiments in ONE
:class:`~attngeom.runs.run.Run`, every record per window (batch size 1), and reads each through its
public result (:class:`~attngeom.runs.contract.ExperimentResult`: tables, summary and the per-window
sums in ``per_window``), so that a bootstrap over windows can resample them
(:mod:`attngeom.stats.resampling`): for ``n_resamples`` resamples (default 1000, seeded) the per-window
sums are re-added with the resample's counts and every statistic below is recomputed, giving a
95 % percentile interval. The one stage of its own is the held-out removal in the fixed regime
order (:func:`attngeom.heads.experiment.removal_nll`, stage ``removal_fixed``) when that order differs from
the calibrated one.

Windows: faithfulness, sinks and selection use all windows; head removal uses the first
``calib_windows`` as the calibration split (taxonomy regimes, single-head sensitivity, the chosen
regime order) and the rest as the held-out split (removal curves). Taxonomy regime shares use all
windows. Each statistic is resampled over the windows it was measured on.

The claims, their wording, what is measured and the verdict rules are in
:mod:`attngeom.claims.catalogue`; each statistic is the analysis's own ``resampled(per_window,
weights)`` (:func:`attngeom.faithfulness.resampled`, :func:`attngeom.sinks.resampled`,
:func:`attngeom.selection.resampled`, :func:`attngeom.heads.resampled` and
:func:`attngeom.heads.resampled_sensitivity`), called once on every window and once on the resamples.

No CLI imports here; :mod:`attngeom.commands.claims` is the command, :mod:`attngeom.reports.claims`
the Markdown.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from attngeom.model.arguments import takes_handle
from attngeom.stats import resampling
from attngeom.runs.contract import ExperimentResult, ModelHandleLike, RunLike
from attngeom.claims.catalogue import (CLAIMS, DEFAULTS, Settings, calibration_evidence, early_critical_row, sized,
                                       faithfulness_rows, regime_rows, removal_row, selection_rows, sink_rows)
from attngeom.faithfulness import experiment as faithfulness
from attngeom.faithfulness.settings import FaithfulnessSettings
from attngeom.heads import experiment as heads
from attngeom.heads import orders as head_orders
from attngeom.heads.settings import HeadsSettings
from attngeom.selection import experiment as selection
from attngeom.selection.settings import SelectionSettings
from attngeom.sinks import experiment as sinks
from attngeom.sinks.settings import SinksSettings


@takes_handle
def experiment(handle: ModelHandleLike, run: RunLike | None, windows: Sequence, settings: Settings = DEFAULTS, *,
               analyses: Sequence[str] = ("faithfulness", "rivals", "sinks", "selection", "heads")) -> ExperimentResult:
    """Run (or resume) the reduced experiments on ``windows`` in ``run`` (a
    :class:`~attngeom.runs.run.Run` or :class:`~attngeom.runs.run.InMemoryRun`), one window per record, and
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
        return resampling.resample_counts(n, st.n_resamples, st.seed * 1000 + salt)

    if "faithfulness" in analyses or "rivals" in analyses:
        r, detail["faithfulness"] = _faithfulness_part(handle, run, ids, st.ratios, st.seeds, counts_for,
                                                       hierarchy="faithfulness" in analyses,
                                                       rivals=st.head_to_head() if "rivals" in analyses else (),
                                                       per_head=st.per_head)
        rows += sized(r, detail["faithfulness"], W)
    if "sinks" in analyses:
        r, detail["sinks"] = _sinks_part(handle, run, ids, counts_for)
        rows += sized(r, detail["sinks"], W)
    if "selection" in analyses:
        r, detail["selection"] = _selection_part(handle, run, ids, st.ns, st.repeats, st.seed, counts_for)
        rows += sized(r, detail["selection"], W)
    if "heads" in analyses:
        r, detail["regimes"], detail["heads"] = _heads_part(handle, run, ids, st.calib_windows, st.retentions,
                                                            st.fixed_order, st.seed, st.critical_k, counts_for)
        rows += r
        info.update({"calibration_windows": st.calib_windows, "heldout_windows": W - st.calib_windows})

    order = {c["id"]: i for i, c in enumerate(CLAIMS)}
    rows.sort(key=lambda r: order[r["id"]])
    recorded = st.record(resampling.DEFAULT_LEVEL)
    table = pd.DataFrame([{k: r[k] for k in ("id", "verdict", "value", "low", "high", "interval")} for r in rows],
                         columns=["id", "verdict", "value", "low", "high", "interval"])
    return ExperimentResult("claims", tables={"claims": table},
                            summary={"rows": rows, "detail": detail, "windows": info, "settings": recorded},
                            settings=recorded)


def _faithfulness_part(handle: ModelHandleLike, run: RunLike, ids, ratios, seeds, counts_for, *, hierarchy: bool = True,
                       rivals: Sequence[str] = (), per_head: bool = False) -> tuple[list[dict], dict]:
    """Claims 1-4 (``hierarchy``: the paper's four metrics) and the head-to-head rows (``rivals``:
    contribution against each of these published measures of SPEC §2.1) from one faithfulness run,
    ranking per head with ``per_head``."""
    from attngeom.metrics import registry

    against = tuple(rivals)
    metrics = (*(registry.hierarchy() if hierarchy else ("contribution",)), *against, "random")
    settings = FaithfulnessSettings(metrics=metrics, ratios=tuple(ratios), seeds=tuple(seeds), per_head=per_head)
    res = faithfulness.experiment(handle, run, units=faithfulness.window_units(ids), settings=settings)
    return faithfulness_rows(faithfulness.resampled(res.per_window),
                             faithfulness.resampled(res.per_window, counts_for(len(ids), 1)), settings.metrics,
                             rivals=against)


def _sinks_part(handle: ModelHandleLike, run: RunLike, ids, counts_for) -> tuple[list[dict], dict]:
    res = sinks.experiment(handle, run, ids, SinksSettings(batch_size=1))
    return sink_rows(sinks.resampled(res.per_window), sinks.resampled(res.per_window, counts_for(len(ids), 2)))


def _selection_part(handle: ModelHandleLike, run: RunLike, ids, ns, repeats, seed, counts_for) -> tuple[list[dict], dict]:
    res = selection.experiment(handle, run, ids, SelectionSettings(ns=tuple(ns), distances=("euclidean",), repeats=repeats,
                                                                   seed=seed, predict=False, batch_size=1))
    point = selection.resampled(res.per_window)
    samples = selection.resampled(res.per_window, counts_for(len(ids), 3))
    return selection_rows(point["mean_f"], samples["mean_f"], point["ns"])


def _heads_part(handle: ModelHandleLike, run: RunLike, ids, calib_windows, retentions, fixed_order, seed, critical_k,
                counts_for) -> tuple[list[dict], dict, dict]:
    """Regime shares, removal (calibrated and fixed regime order) and the early critical head, from
    the heads experiment's result (and one more removal stage for the fixed order when it differs
    from the calibrated one)."""
    from attngeom.heads.taxonomy import REGIMES

    res = heads.experiment(handle, run, [ids], HeadsSettings(calib_windows=calib_windows, retentions=tuple(retentions),
                                                             seed=seed, critical_k=critical_k, batch_size=1))
    W = len(ids)
    rows, regimes_detail = regime_rows(heads.resampled(res.per_window)["regime_shares"],
                                       heads.resampled(res.per_window, counts_for(W, 4))["regime_shares"])
    rows = sized(rows, regimes_detail, W)

    held = ids[calib_windows:]
    Wh, Wc = len(held), calib_windows
    chosen = list(res.summary["taxonomy_regime_order"])
    fixed = [str(x) for x in fixed_order]
    levels = [x for x in retentions if x < 100]
    cal_df = res.tables["taxonomy_calibration"]
    extra = None
    if fixed != chosen:
        removals = [head_orders.removed_at(head_orders.taxonomy_order(cal_df, fixed), x) for x in levels]
        nll_f, _ = heads.removal_nll(handle, run, "removal_fixed", held, removals, 1, "removal: fixed regime order")
        extra = {("fixed", x): nll_f[i] for i, x in enumerate(levels)}
    ppl_point = {k: v[0] for k, v in heads.resampled_removal(res.per_window, None, extra).items()}
    ppl_samples = heads.resampled_removal(res.per_window, counts_for(Wh, 5), extra)
    if extra is None:                                   # the fixed order is the calibrated one
        for x in levels:
            ppl_point[("fixed", x)], ppl_samples[("fixed", x)] = ppl_point[("taxonomy", x)], ppl_samples[("taxonomy", x)]
    names = list(head_orders.ORDERS) + ["fixed"]
    for x in retentions:
        if x >= 100:
            for name in names:
                ppl_point[(name, x)], ppl_samples[(name, x)] = ppl_point[("", 100.0)], ppl_samples[("", 100.0)]
    curves = {}
    for name in names:
        label = {"taxonomy": f"taxonomy, chosen on calibration ({' > '.join(chosen)})",
                 "fixed": f"taxonomy, fixed ({' > '.join(fixed)})"}.get(name, name)
        curves[label] = {f"{x:g}": resampling.interval_dict(ppl_point[(name, x)], ppl_samples[(name, x)], units=Wh)
                         for x in retentions}
    fixed_point = {**ppl_point, **{("taxonomy", x): ppl_point[("fixed", x)] for x in retentions}}
    fixed_samples = {**ppl_samples, **{("taxonomy", x): ppl_samples[("fixed", x)] for x in retentions}}
    rows += sized([removal_row("taxonomy_removal_calibrated", chosen, ppl_point, ppl_samples, retentions),
                   removal_row("taxonomy_removal_fixed", fixed, fixed_point, fixed_samples, retentions)], {}, Wh)

    row, head = _early_critical_claim(handle, res, Wc, cal_df, critical_k, counts_for)
    rows += calibration_evidence(sized([row], head, Wc), Wc)
    detail = {
        "regime_order_chosen": chosen, "regime_order_fixed": fixed,
        "order_search": res.tables["order_search"].to_dict(orient="records"),
        "removal_curves": curves, "critical_heads": res.summary["critical_heads"],
        "early_critical_head": head, "calibration_windows": Wc, "heldout_windows": Wh,
        "regimes": [str(x) for x in REGIMES],
    }
    return rows, regimes_detail, detail


def _early_critical_claim(handle: ModelHandleLike, res: ExperimentResult, calib_windows: int, cal_df,
                          critical_k: float, counts_for) -> tuple[dict, dict]:
    """The largest leave-one-out z of an early head's single-removal ΔPPL (calibration windows)."""

    L, H = handle.num_layers, handle.num_heads
    regimes = cal_df.sort_values(["layer", "head"])["regime"].to_numpy()

    def early_z(cnt):
        delta = heads.resampled_sensitivity(res.per_window, cnt)["delta"]
        z = head_orders.critical_z(delta, regimes)
        early = np.array([(k // H) * 3 < L for k in range(L * H)])
        ze = np.where(early[None] & np.isfinite(z), z, -np.inf)
        return ze.max(1), ze.argmax(1), delta

    zp, kp, dp = early_z(None)
    zs, ks, ds = early_z(counts_for(calib_windows, 6))
    zs = np.where(np.isfinite(zs), zs, np.nan)
    zi = resampling.interval_dict(zp[0] if np.isfinite(zp[0]) else np.nan, zs)
    k0 = int(kp[0])
    same = float(np.mean(ks == k0))
    head = {"layer": k0 // H, "head": k0 % H, "regime": str(regimes[k0]), "delta_ppl": float(dp[0, k0]),
            "delta_ppl_interval": resampling.interval_dict(dp[0, k0], ds[:, k0]), "top_in_resamples": same}
    row = early_critical_row(zi, head, same, L, heads.calibration_perplexity(res.per_window), critical_k)
    return row, head


# --------------------------------------------------------------------------------------------
# The command's summary.json: built here, and read back here for the report's headline
# --------------------------------------------------------------------------------------------


def headline(summary: dict) -> list[tuple[str, str]]:
    """The headline of ``attngeom claims``' short report (beside claims.md) from the summary
    :func:`experiment` returns: how many claims got each verdict."""
    counts: dict[str, int] = {}
    for r in summary["rows"]:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    return [("verdicts", ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "—")]
